// The device K loop (matmul.h) on three instruction paths that give the same bits: AVX512-BF16 (vdpbf16ps:
// each lane adds its odd then its even product as FMAs with DAZ inputs, an FTZ result and RNE), AVX2 + FMA
// (the same two FMAs per lane on widened values, with MXCSR's FTZ and DAZ set), and a portable scalar path
// that emulates those modes exactly. The products are exact (bf16 x bf16, e4m3 x e4m3), so an FMA equals the
// add of the exact product; the SIMD paths run the lane tree and the scale products under the same MXCSR
// modes, the portable path through the emulated add and multiply. Also the activation rounding.
#include <algorithm>
#include <array>
#include <atomic>

#include "backend/cpu/matmul_kernels.h"
#include "core/check.h"
#include "core/device_numerics.h"
#include "core/float_formats.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define MEMRA_X86 1
#else
#define MEMRA_X86 0
#endif

namespace memra::cpu {

// ---------------------------------------------------------------------------------------------
// Activation rounding.

// At most this many values are rounded without the pool (a few microseconds).
constexpr int64_t kSerialRoundingValues = int64_t{1} << 15;

void round_activations(ThreadPool &pool, const float *x, int64_t n_tokens, int64_t k, ActRounding act,
                       const ActScratch &scratch) {
    MEMRA_CHECK(act != ActRounding::kNone, "round_activations: f32 activations are not rounded");
    MEMRA_CHECK(n_tokens >= 0 && k > 0, "round_activations: bad shape [{}, {}]", n_tokens, k);
    MEMRA_CHECK(scratch.codes != nullptr && scratch.codes_capacity >= n_tokens * k,
                "matmul: the activation scratch holds {} values, the product needs {} ([{}, {}])",
                scratch.codes_capacity, n_tokens * k, n_tokens, k);
    const int64_t groups = (k + kE4m3Group - 1) / kE4m3Group;
    MEMRA_CHECK(act != ActRounding::kE4m3x128 ||
                    (scratch.scales != nullptr && scratch.scales_capacity >= n_tokens * groups),
                "matmul: the activation scratch holds {} scales, the product needs {}", scratch.scales_capacity,
                n_tokens * groups);
    const auto round_rows = [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float *xr = x + t * k;
            uint16_t *codes = scratch.codes + t * k;
            if (act == ActRounding::kBf16) {
                for (int64_t i = 0; i < k; ++i) codes[i] = f32_to_bf16(xr[i]);
                continue;
            }
            float values[kE4m3Group];
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t g0 = g * kE4m3Group;
                const int64_t len = std::min(k, g0 + kE4m3Group) - g0;
                scratch.scales[t * groups + g] = e4m3_quantize_group(xr + g0, len, values);
                // Exact: every e4m3 value is a bf16 value.
                for (int64_t i = 0; i < len; ++i) codes[g0 + i] = f32_to_bf16(values[i]);
            }
        }
    };
    // A few rows (decode) round on the calling thread: cheaper than waking the pool a second time per product.
    if (n_tokens * k <= kSerialRoundingValues) {
        round_rows(0, n_tokens);
    } else {
        pool.parallel_for(n_tokens, round_rows);
    }
}

namespace detail {
namespace {

// e4m3 code -> its value's bf16 bits (exact), for the portable path and chunk tails.
const std::array<uint16_t, 256> &e4m3_bf16_table() {
    static const std::array<uint16_t, 256> table = [] {
        std::array<uint16_t, 256> t{};
        for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = f32_to_bf16(fp8_e4m3_to_f32(static_cast<uint8_t>(c)));
        return t;
    }();
    return table;
}

// Elements [k, k + n) of a weight row as bf16 bits, zero-padded to 32 (n <= 32).
template <DType kDt>
void weight_group_bf16(const void *row, int64_t k, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < kDeviceGroup; ++i) out[i] = 0;
    if constexpr (kDt == DType::kBF16) {
        std::memcpy(out, static_cast<const uint16_t *>(row) + k, static_cast<size_t>(n) * 2);
    } else {
        const uint8_t *p = static_cast<const uint8_t *>(row) + k;
        const auto &table = e4m3_bf16_table();
        for (int64_t i = 0; i < n; ++i) out[i] = table[p[i]];
    }
}

// ---------------------------------------------------------------------------------------------
// The portable path: FTZ/DAZ arithmetic emulated (core/device_numerics.h).

struct PortablePath {
    static constexpr int kTileRows = 4;
    static constexpr int kTileTokens = 4;
    using Acc = std::array<float, 16>;
    struct Group {
        uint16_t v[kDeviceGroup];
    };
    static Acc zero() { return Acc{}; }
    static void prefetch(const void *) {}
    static Group load_x(const uint16_t *p, int64_t n) {
        Group g{};
        std::memcpy(g.v, p, static_cast<size_t>(n) * 2);
        return g;
    }
    template <DType kDt>
    static Group load_w(const void *row, int64_t k, int64_t n) {
        Group g;
        weight_group_bf16<kDt>(row, k, n, g.v);
        return g;
    }
    static void fma(Acc &acc, const Group &x, const Group &w) {
        for (int j = 0; j < 16; ++j) {
            acc[j] = fz_fma(bf16_to_f32(x.v[2 * j + 1]), bf16_to_f32(w.v[2 * j + 1]), acc[j]);
            acc[j] = fz_fma(bf16_to_f32(x.v[2 * j]), bf16_to_f32(w.v[2 * j]), acc[j]);
        }
    }
    static void reduce(const Acc *acc, int n, float *out) {
        for (int a = 0; a < n; ++a) {
            const Acc &l = acc[a];
            const auto s = [&](int i) { return fz_add(l[i], l[i + 1]); };
            out[a] = fz_add(fz_add(fz_add(s(0), s(2)), fz_add(s(4), s(6))), fz_add(fz_add(s(8), s(10)), fz_add(s(12), s(14))));
        }
    }
    static float add(float a, float b) { return fz_add(a, b); }
    static float mul(float a, float b) { return fz_mul(a, b); }
};

namespace portable {
#include "backend/cpu/matmul_device_tile.inc"
}  // namespace portable

#if MEMRA_X86
#define MEMRA_SIMD [[gnu::always_inline]] inline

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// The lane tree of matmul.h, ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) + (the same over l8..l15), for the 16 lanes
// lo = l0..l7, hi = l8..l15. hadd(lo, hi) = [p0 p1 p4 p5 p2 p3 p6 p7] with p_i = l_2i + l_2i+1 (addition is
// commutative, so hadd's operand order does not show); hadd again gives [q0 q2 q0 q2 q1 q3 q1 q3], q_j = p_2j +
// p_2j+1; its halves added give [q0+q1, q2+q3, ..]; those two added are the sum.
MEMRA_SIMD float lane_sum16(__m256 lo, __m256 hi) {
    const __m256 p = _mm256_hadd_ps(lo, hi);
    const __m256 q = _mm256_hadd_ps(p, p);
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

// What the SIMD paths share: plain scalar operations (MXCSR gives them FTZ/DAZ).
struct SimdOps {
    // Prefetching never faults, so an address past the weight is harmless.
    MEMRA_SIMD static void prefetch(const void *p) { _mm_prefetch(static_cast<const char *>(p), _MM_HINT_T0); }
    static float add(float a, float b) { return a + b; }
    static float mul(float a, float b) { return a * b; }
};

struct Avx2Path : SimdOps {
    // 2 x 2 accumulators of two registers each: half of AVX2's 16, the rest for the converted operands.
    static constexpr int kTileRows = 4;
    static constexpr int kTileTokens = 1;
    struct Acc {
        __m256 lo, hi;  // lanes 0-7, 8-15
    };
    struct Group {
        __m256i lo, hi;  // 16 bf16 each: the pairs of lanes 0-7, 8-15
    };
    MEMRA_SIMD static Acc zero() { return Acc{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    MEMRA_SIMD static Group load32(const uint16_t *p) {
        return Group{_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)),
                     _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 16))};
    }
    MEMRA_SIMD static Group load_x(const uint16_t *p, int64_t n) {
        if (n == kDeviceGroup) return load32(p);
        alignas(32) uint16_t buf[kDeviceGroup] = {};
        std::memcpy(buf, p, static_cast<size_t>(n) * 2);
        return load32(buf);
    }
    template <DType kDt>
    MEMRA_SIMD static Group load_w(const void *row, int64_t k, int64_t n) {
        if (kDt == DType::kBF16 && n == kDeviceGroup) return load_x(static_cast<const uint16_t *>(row) + k, n);
        if (kDt == DType::kF8E4M3 && n == kDeviceGroup) {
            const uint8_t *p = static_cast<const uint8_t *>(row) + k;
            return Group{e4m3_to_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))),
                         e4m3_to_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 16)))};
        }
        alignas(32) uint16_t buf[kDeviceGroup];
        weight_group_bf16<kDt>(row, k, n, buf);
        return load32(buf);
    }
    // 16 e4m3 codes -> 16 bf16 bit patterns (exact).
    MEMRA_SIMD static __m256i e4m3_to_bf16(__m128i codes) {
        const __m256i c = _mm256_cvtepu8_epi16(codes);
        const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi16(0x7f));
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8);
        const __m256i normal = _mm256_add_epi16(_mm256_slli_epi16(mag, 4), _mm256_set1_epi16(0x3c00));
        // Subnormals m * 2^-9 (m = 1..7) and zero, looked up per byte: bf16 bits 0x3b00 0x3b80 0x3bc0 0x3c00
        // 0x3c20 0x3c40 0x3c60 (low bytes 0, 0, 0xc0, 0, 0x20, 0x40, 0x60; high 0x3b 0x3b 0x3b 0x3c ...).
        const __m256i lut_lo = _mm256_setr_epi8(0, 0, static_cast<char>(0x80), static_cast<char>(0xc0), 0, 0x20, 0x40, 0x60, 0, 0, 0, 0,
                                                0, 0, 0, 0, 0, 0, static_cast<char>(0x80), static_cast<char>(0xc0), 0, 0x20, 0x40, 0x60, 0, 0,
                                                0, 0, 0, 0, 0, 0);
        const __m256i lut_hi = _mm256_setr_epi8(0, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0, 0, 0, 0, 0, 0, 0, 0);
        // mag < 8 fits pshufb's 4-bit index; the index byte sits in the low byte of each 16-bit lane.
        const __m256i lo = _mm256_and_si256(_mm256_shuffle_epi8(lut_lo, mag), _mm256_set1_epi16(0x00ff));
        const __m256i hi = _mm256_slli_epi16(_mm256_shuffle_epi8(lut_hi, mag), 8);
        const __m256i sub = _mm256_or_si256(lo, hi);
        __m256i bits = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi16(_mm256_set1_epi16(8), mag));
        bits = _mm256_blendv_epi8(bits, _mm256_set1_epi16(0x7fc0), _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f)));
        return _mm256_or_si256(bits, sign);
    }
    MEMRA_SIMD static __m256 even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
    MEMRA_SIMD static __m256 odd(__m256i v) {
        return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    MEMRA_SIMD static void reduce(const Acc *acc, int n, float *out) {
        for (int a = 0; a < n; ++a) out[a] = lane_sum16(acc[a].lo, acc[a].hi);
    }
    MEMRA_SIMD static void fma(Acc &acc, const Group &x, const Group &w) {
        acc.lo = _mm256_fmadd_ps(odd(x.lo), odd(w.lo), acc.lo);
        acc.lo = _mm256_fmadd_ps(even(x.lo), even(w.lo), acc.lo);
        acc.hi = _mm256_fmadd_ps(odd(x.hi), odd(w.hi), acc.hi);
        acc.hi = _mm256_fmadd_ps(even(x.hi), even(w.hi), acc.hi);
    }
};

namespace avx2 {
#include "backend/cpu/matmul_device_tile.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")
struct Avx512Bf16Path : SimdOps {
    static constexpr int kTileRows = 4;  // 16 of the 32 registers accumulate
    static constexpr int kTileTokens = 4;
    using Acc = __m512;
    using Group = __m512i;  // 32 bf16: the pairs of lanes 0-15
    MEMRA_SIMD static Acc zero() { return _mm512_setzero_ps(); }
    MEMRA_SIMD static __mmask32 tail_mask(int64_t n) {
        return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1u);
    }
    MEMRA_SIMD static Group load_x(const uint16_t *p, int64_t n) { return _mm512_maskz_loadu_epi16(tail_mask(n), p); }
    template <DType kDt>
    MEMRA_SIMD static Group load_w(const void *row, int64_t k, int64_t n) {
        if constexpr (kDt == DType::kBF16) {
            return load_x(static_cast<const uint16_t *>(row) + k, n);
        } else {
            const __m256i bytes = _mm256_maskz_loadu_epi8(tail_mask(n), static_cast<const uint8_t *>(row) + k);
            const __m512i c = _mm512_cvtepu8_epi16(bytes);
            const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7f));
            const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8);
            const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3c00));
            const __m512i sub_lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                     0, 0, 0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0);
            const __m512i sub = _mm512_permutexvar_epi16(mag, sub_lut);
            __m512i bits = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), normal, sub);
            bits = _mm512_mask_blend_epi16(_mm512_cmpeq_epu16_mask(mag, _mm512_set1_epi16(0x7f)), bits,
                                           _mm512_set1_epi16(0x7fc0));
            return _mm512_or_si512(bits, sign);
        }
    }
    MEMRA_SIMD static void fma(Acc &acc, const Group &x, const Group &w) {
        acc = _mm512_dpbf16_ps(acc, vec_bits<__m512bh>(x), vec_bits<__m512bh>(w));
    }
    MEMRA_SIMD static void reduce(const Acc *acc, int n, float *out) {
        for (int a = 0; a < n; ++a) {
            alignas(64) float l[16];
            _mm512_store_ps(l, acc[a]);
            out[a] = lane_sum16(_mm256_load_ps(l), _mm256_load_ps(l + 8));
        }
    }
};

namespace avx512 {
#include "backend/cpu/matmul_device_tile.inc"
}  // namespace avx512
#pragma GCC pop_options
#undef MEMRA_SIMD
#endif

[[gnu::noinline]] void run_portable(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    if (task.w->dtype == DType::kBF16) {
        portable::device_range<PortablePath, DType::kBF16>(task, rb, re, tb, te);
    } else {
        portable::device_range<PortablePath, DType::kF8E4M3>(task, rb, re, tb, te);
    }
}

#if MEMRA_X86
[[gnu::target("avx2,fma"), gnu::noinline]] void run_avx2(const Task &task, int64_t rb, int64_t re, int64_t tb,
                                                        int64_t te) {
    if (task.w->dtype == DType::kBF16) {
        avx2::device_range<Avx2Path, DType::kBF16>(task, rb, re, tb, te);
    } else {
        avx2::device_range<Avx2Path, DType::kF8E4M3>(task, rb, re, tb, te);
    }
}

[[gnu::target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16"), gnu::noinline]] void run_avx512bf16(const Task &task,
                                                                                          int64_t rb, int64_t re,
                                                                                          int64_t tb, int64_t te) {
    if (task.w->dtype == DType::kBF16) {
        avx512::device_range<Avx512Bf16Path, DType::kBF16>(task, rb, re, tb, te);
    } else {
        avx512::device_range<Avx512Bf16Path, DType::kF8E4M3>(task, rb, re, tb, te);
    }
}

// MXCSR with flush-to-zero (bit 15) and denormals-are-zero (bit 6) set, restored on exit. The kernels run in
// separate non-inlined functions, so no floating-point operation moves across the mode change.
class FtzDazScope {
public:
    FtzDazScope() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
    ~FtzDazScope() { _mm_setcsr(saved_); }
    FtzDazScope(const FtzDazScope &) = delete;
    FtzDazScope &operator=(const FtzDazScope &) = delete;

private:
    unsigned saved_;
};
#endif

ProductIsa best_isa() {
#if MEMRA_X86
    if (product_isa_supported(ProductIsa::kAvx512Bf16)) return ProductIsa::kAvx512Bf16;
    if (product_isa_supported(ProductIsa::kAvx2Fma)) return ProductIsa::kAvx2Fma;
#endif
    return ProductIsa::kPortable;
}

std::atomic<ProductIsa> &isa_choice() {
    static std::atomic<ProductIsa> choice{best_isa()};
    return choice;
}

}  // namespace

void run_device_range(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    switch (product_isa()) {
#if MEMRA_X86
        case ProductIsa::kAvx512Bf16: {
            const FtzDazScope mode;
            run_avx512bf16(task, rb, re, tb, te);
            return;
        }
        case ProductIsa::kAvx2Fma: {
            const FtzDazScope mode;
            run_avx2(task, rb, re, tb, te);
            return;
        }
#endif
        default: run_portable(task, rb, re, tb, te); return;
    }
}

}  // namespace detail

const char *product_isa_name(ProductIsa isa) {
    switch (isa) {
        case ProductIsa::kAvx512Bf16: return "avx512-bf16";
        case ProductIsa::kAvx2Fma: return "avx2-fma";
        case ProductIsa::kPortable: break;
    }
    return "portable";
}

bool product_isa_supported(ProductIsa isa) {
    switch (isa) {
        case ProductIsa::kPortable: return true;
#if MEMRA_X86
        case ProductIsa::kAvx2Fma: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case ProductIsa::kAvx512Bf16:
            return __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#endif
        default: return false;
    }
}

ProductIsa product_isa() { return detail::isa_choice().load(std::memory_order_relaxed); }

bool force_product_isa(ProductIsa isa) {
    if (!product_isa_supported(isa)) return false;
    detail::isa_choice().store(isa, std::memory_order_relaxed);
    return true;
}

}  // namespace memra::cpu
