// Scalar definitions of the `device` numerics' rounding points and dot product (ENGINE.md section 4,
// backend/cpu/matmul.h "The device K loop"), as plain host code: the CPU kernels' portable path and the
// verify gates' per-expert oracle are written with them. Arithmetic "fz" runs in FTZ/DAZ mode, as the
// AVX512-BF16 instruction vdpbf16ps and MXCSR's FTZ + DAZ do: a denormal input counts as a zero of its sign,
// a result that is tiny after rounding (at unbounded exponent range) becomes a zero of its sign, round to
// nearest even.
#pragma once

#include <cstdint>

namespace memra {

float fz_add(float a, float b);
float fz_mul(float a, float b);
// c + a * b with one rounding. Exact for the products the device loop forms (bf16 x bf16, e4m3 x e4m3): the
// emulation goes through double, where such a sum is rounded at most once before the float rounding.
float fz_fma(float a, float b, float c);

// The e4m3 quantization of one activation group of n <= 128 values: amax = max |x| (a NaN never wins),
// scale = amax / 448 by IEEE division (1 when amax = 0, 2^-149 when the division underflows), value i = the e4m3 value of
// f32_to_fp8_e4m3(x[i] / scale, saturate). Returns the scale.
float e4m3_quantize_group(const float *x, int64_t n, float *values);
// The scale of a group whose amax (max |x|, NaN never winning) is `amax`: the rule above.
float e4m3_group_scale(float amax);

// One chunk of the device K loop over n values (bf16 or e4m3 values as f32, and the weight's stored values):
// 16 lanes from +0; groups of 32 from element 0 (the last zero-padded), lane j adding element 32g + 2j + 1 then
// 32g + 2j by fz_fma; the lane tree ((l0+l1)+(l2+l3))+... by fz_add.
float device_chunk_dot(const float *x, const float *w, int64_t n);

}  // namespace memra
