// Exact conversions between float32 and the narrow float formats memra stores: bfloat16, IEEE binary16
// and float8_e4m3fn. Integer bit manipulation only (no libm, no intrinsics) and MEMRA_HD, so the CPU
// backend and the CUDA kernels produce the same bits (DETERMINISM.md rule 7). Rounding, overflow and NaN
// rules are those of ml_dtypes (bf16, fp8) and numpy (fp16), pinned by tests/oracle/test_dtypes.py.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/hd.h"

namespace memra {

// Bit casts; std::memcpy compiles to a register move on both sides (nvcc accepts it in device code).
MEMRA_HD uint32_t f32_as_u32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}

MEMRA_HD float u32_as_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

namespace detail {

// Shifts `m` right by `shift` (1..31) with round-to-nearest-even on the dropped bits.
MEMRA_HD uint32_t shift_right_rne(uint32_t m, uint32_t shift) {
    const uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    return (rem > half || (rem == half && (q & 1u))) ? q + 1u : q;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// bfloat16: the top half of a float32. Exact widening; narrowing rounds to nearest even. A NaN
// becomes the canonical quiet NaN 0x7fc0 with the input's sign (ml_dtypes drops the payload).
// Subnormals share float32's exponent range, so they round like any other value.

MEMRA_HD float bf16_to_f32(uint16_t h) { return u32_as_f32(static_cast<uint32_t>(h) << 16); }

MEMRA_HD uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_as_u32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
    }
    // Adding 0x7fff plus the kept LSB rounds ties to even; a carry out of the mantissa bumps the
    // exponent (up to Inf for values at or above the max finite's midpoint). Cannot wrap 32 bits.
    const uint32_t lsb = (u >> 16) & 1u;
    return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

// ---------------------------------------------------------------------------------------------
// IEEE binary16 (5 exponent bits, bias 15, 10 mantissa bits, max 65504, subnormals down to 2^-24).
// Widening is exact and keeps NaN payloads (as numpy does). Narrowing rounds to nearest even,
// overflows to Inf from 65520 (the midpoint above 65504) and keeps a NaN's sign and top 10 payload
// bits, forcing payload 1 if they are all zero, exactly as numpy's float32 -> float16 cast: a quiet
// NaN stays quiet (bit 22 lands on bit 9); a signaling one stays signaling, as numpy leaves it.

MEMRA_HD float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) {
        return u32_as_f32(sign | 0x7f800000u | (man << 13));
    }
    if (exp != 0) {
        return u32_as_f32(sign | ((exp + 112u) << 23) | (man << 13));
    }
    if (man == 0) {
        return u32_as_f32(sign);
    }
    // Subnormal: man * 2^-24. Normalise so the leading one sits at bit 10.
    uint32_t exp32 = 113;  // float32 exponent field of 2^-14
    while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp32;
    }
    return u32_as_f32(sign | (exp32 << 23) | ((man & 0x3ffu) << 13));
}

MEMRA_HD uint16_t f32_to_f16(float f) {
    const uint32_t u = f32_as_u32(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) {
        if (a == 0x7f800000u) {
            return static_cast<uint16_t>(sign | 0x7c00u);
        }
        const uint32_t payload = (a & 0x7fffffu) >> 13;
        return static_cast<uint16_t>(sign | 0x7c00u | (payload == 0 ? 1u : payload));
    }
    if (a >= 0x477ff000u) {  // >= 65520: rounds past 65504 (odd mantissa, so the tie goes up)
        return static_cast<uint16_t>(sign | 0x7c00u);
    }
    const uint32_t exp = a >> 23;
    const uint32_t man = (a & 0x7fffffu) | 0x800000u;
    if (exp < 113) {  // below 2^-14: a binary16 subnormal (units of 2^-24) or zero
        if (a <= 0x33000000u) {  // <= 2^-25: half the smallest subnormal or less, ties to even 0
            return static_cast<uint16_t>(sign);
        }
        // value = man * 2^(exp-150) = (man >> (126-exp)) * 2^-24, with 14 <= 126-exp <= 24.
        // Rounding up to 0x400 yields the smallest normal, which is the right encoding.
        return static_cast<uint16_t>(sign | detail::shift_right_rne(man, 126u - exp));
    }
    // Normal: re-bias the exponent, drop 13 mantissa bits; a rounding carry moves into the exponent.
    const uint32_t packed = ((exp - 112u) << 10) | ((man & 0x7fffffu) >> 13);
    const uint32_t rem = man & 0x1fffu;
    const uint32_t rounded = (rem > 0x1000u || (rem == 0x1000u && (packed & 1u))) ? packed + 1u : packed;
    return static_cast<uint16_t>(sign | rounded);
}

// ---------------------------------------------------------------------------------------------
// float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, subnormals (m * 2^-9), max 448, no
// infinities, NaN = S.1111.111 (0x7f / 0xff). Widening is exact; a NaN widens to the quiet NaN
// 0x7fc00000 with its sign. Narrowing rounds to nearest even. The two saturation modes differ only for
// +-Inf and for finite values that round past 448 (|x| > 464, the midpoint to the missing 480):
//   kNonSaturating: those become NaN with the input's sign. This is ml_dtypes' float32 ->
//                   float8_e4m3fn cast bit for bit (so 464 -> 448, 464+ulp -> NaN, Inf -> NaN).
//   kSaturate:      those clamp to +-448 (0x7e / 0xfe), the convention of FP8 weight quantizers.
// Both modes: NaN -> 0x7f / 0xff (sign kept, payload dropped), -0 -> 0x80, |x| <= 2^-10 -> +-0.

enum class Fp8Saturation { kSaturate, kNonSaturating };

MEMRA_HD float fp8_e4m3_to_f32(uint8_t c) {
    const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
    const uint32_t exp = (c >> 3) & 0xfu;
    uint32_t man = c & 0x7u;
    if ((c & 0x7fu) == 0x7fu) {
        return u32_as_f32(sign | 0x7fc00000u);
    }
    if (exp != 0) {
        return u32_as_f32(sign | ((exp + 120u) << 23) | (man << 20));
    }
    if (man == 0) {
        return u32_as_f32(sign);
    }
    // Subnormal: man * 2^-9. Normalise so the leading one sits at bit 3.
    uint32_t exp32 = 121;  // float32 exponent field of 2^-6
    while ((man & 0x8u) == 0) {
        man <<= 1;
        --exp32;
    }
    return u32_as_f32(sign | (exp32 << 23) | ((man & 0x7u) << 20));
}

MEMRA_HD uint8_t f32_to_fp8_e4m3(float f, Fp8Saturation saturation) {
    const uint32_t u = f32_as_u32(f);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return static_cast<uint8_t>(sign | 0x7fu);
    }
    if (a > 0x43e80000u) {  // > 464 (this includes Inf): rounds past the max finite 448
        return static_cast<uint8_t>(sign | (saturation == Fp8Saturation::kSaturate ? 0x7eu : 0x7fu));
    }
    const uint32_t exp = a >> 23;
    const uint32_t man = (a & 0x7fffffu) | 0x800000u;
    if (exp < 121) {  // below 2^-6: an e4m3 subnormal (units of 2^-9) or zero
        if (a <= 0x3a800000u) {  // <= 2^-10: half the smallest subnormal or less, ties to even 0
            return static_cast<uint8_t>(sign);
        }
        // value = man * 2^(exp-150) = (man >> (141-exp)) * 2^-9, with 21 <= 141-exp <= 24.
        // Rounding up to 8 yields the smallest normal, which is the right encoding.
        return static_cast<uint8_t>(sign | detail::shift_right_rne(man, 141u - exp));
    }
    // Normal: re-bias (127 -> 7), drop 20 mantissa bits. 464 itself ties to the even 448 (0x7e), so
    // a rounding carry never reaches the NaN code.
    const uint32_t packed = ((exp - 120u) << 3) | ((man & 0x7fffffu) >> 20);
    const uint32_t rem = man & 0xfffffu;
    const uint32_t rounded = (rem > 0x80000u || (rem == 0x80000u && (packed & 1u))) ? packed + 1u : packed;
    return static_cast<uint8_t>(sign | rounded);
}

}  // namespace memra
