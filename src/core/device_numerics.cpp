// Scalar device numerics (device_numerics.h). Every operand below has at most 24 significant bits and every
// product formed at most 48, so the double result of one operation is rounded at most once, and rounding it
// again to float gives the correctly rounded float result (53 >= 2 * 24 + 2).
#include "core/device_numerics.h"

#include <cfloat>
#include <cmath>
#include <initializer_list>

#include "core/float_formats.h"

namespace memra {
namespace {

float daz(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0f, v) : v; }

// d rounded to float with FTZ: a result whose rounding at unbounded exponent range is below FLT_MIN becomes a
// zero of its sign (x86 detects tininess after rounding).
float ftz_round(double d) {
    if (std::fabs(d) >= static_cast<double>(FLT_MIN) || std::isnan(d)) return static_cast<float>(d);
    const float scaled = static_cast<float>(std::ldexp(d, 64));  // the same rounding, in the normal range
    return std::fabs(scaled) >= std::ldexp(FLT_MIN, 64) ? std::copysign(FLT_MIN, scaled) : std::copysign(0.0f, scaled);
}

}  // namespace

float fz_add(float a, float b) { return ftz_round(static_cast<double>(daz(a)) + static_cast<double>(daz(b))); }
float fz_mul(float a, float b) { return ftz_round(static_cast<double>(daz(a)) * static_cast<double>(daz(b))); }
float fz_fma(float a, float b, float c) {
    return ftz_round(static_cast<double>(daz(c)) + static_cast<double>(daz(a)) * static_cast<double>(daz(b)));
}

float e4m3_quantize_group(const float *x, int64_t n, float *values) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        const float a = std::fabs(x[i]);
        amax = a > amax ? a : amax;  // a NaN never wins
    }
    const float scale = e4m3_group_scale(amax);
    for (int64_t i = 0; i < n; ++i) values[i] = fp8_e4m3_to_f32(f32_to_fp8_e4m3(x[i] / scale, Fp8Saturation::kSaturate));
    return scale;
}

float e4m3_group_scale(float amax) {
    if (amax == 0.0f) return 1.0f;
    const float scale = amax / 448.0f;
    return scale == 0.0f ? 0x1p-149f : scale;  // amax / 448 underflowed: the smallest scale, as the weight quantizer
}

float device_chunk_dot(const float *x, const float *w, int64_t n) {
    float l[16] = {};
    for (int64_t g = 0; g < n; g += 32) {
        for (int64_t j = 0; j < 16; ++j) {
            for (const int64_t k : {g + 2 * j + 1, g + 2 * j}) {
                l[j] = k < n ? fz_fma(x[k], w[k], l[j]) : fz_fma(0.0f, 0.0f, l[j]);
            }
        }
    }
    const auto p = [&](int i) { return fz_add(l[i], l[i + 1]); };
    return fz_add(fz_add(fz_add(p(0), p(2)), fz_add(p(4), p(6))), fz_add(fz_add(p(8), p(10)), fz_add(p(12), p(14))));
}

}  // namespace memra
