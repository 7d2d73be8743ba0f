// The device K loop (matmul.h) on three instruction paths that give the same bits: AVX512-BF16 (vdpbf16ps:
// each lane adds its odd then its even product as FMAs with DAZ inputs, an FTZ result and RNE), AVX2 + FMA
// (the same two FMAs per lane on widened values, with MXCSR's FTZ and DAZ set), and a portable scalar path
// that emulates those modes exactly. The products are exact (bf16 x bf16, e4m3 x e4m3), so an FMA equals the
// add of the exact product; the SIMD paths run the lane tree and the scale products under the same MXCSR
// modes, the portable path through the emulated add and multiply. On AVX512-BF16, weights with 16-row panels
// (WeightPanels, made at upload) run with rows in the lanes, so a chunk's lane tree is vertical adds. Also the
// activation rounding and the panels' layout.
#include <algorithm>
#include <array>
#include <atomic>

#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/simd_avx2.h"
#include "core/check.h"
#include "core/device_numerics.h"
#include "core/float_formats.h"


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
            detail::round_row(x + t * k, k, act, scratch.codes + t * k,
                              act == ActRounding::kE4m3x128 ? scratch.scales + t * groups : nullptr);
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
    static constexpr int vector_rows(int64_t) { return 0; }
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

// lane_sum16 of four accumulators at once, each by its own tree: level 1 is hadd(lo, hi) = [p0 p1 p4 p5 | p2 p3 p6
// p7] per accumulator; hadd of two of those gives [q0 q2 q0' q2' | q1 q3 q1' q3'] (q_j = p_2j + p_2j+1); the halves
// of two such vectors side by side add to [r0 r1 r0' r1' | ..] (r0 = q0 + q1: lanes 0-7, r1: lanes 8-15); a last
// hadd forms r0 + r1. Returns the four sums in order.
MEMRA_SIMD __m128 lane_sum16_x4(__m256 lo0, __m256 hi0, __m256 lo1, __m256 hi1, __m256 lo2, __m256 hi2, __m256 lo3,
                                __m256 hi3) {
    const __m256 q01 = _mm256_hadd_ps(_mm256_hadd_ps(lo0, hi0), _mm256_hadd_ps(lo1, hi1));
    const __m256 q23 = _mm256_hadd_ps(_mm256_hadd_ps(lo2, hi2), _mm256_hadd_ps(lo3, hi3));
    const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(q01, q23, 0x20), _mm256_permute2f128_ps(q01, q23, 0x31));
    const __m256 f = _mm256_hadd_ps(r, r);  // [s0 s1 s0 s1 | s2 s3 s2 s3]
    return _mm_shuffle_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1), 0x44);
}

// What the SIMD paths share: plain scalar operations (MXCSR gives them FTZ/DAZ).
struct SimdOps {
    // Prefetching never faults, so an address past the weight is harmless.
    MEMRA_SIMD static void prefetch(const void *p) { _mm_prefetch(static_cast<const char *>(p), _MM_HINT_T0); }
    static float add(float a, float b) { return a + b; }
    static float mul(float a, float b) { return a * b; }
};

struct Avx2Path : SimdOps {
    static constexpr int vector_rows(int64_t) { return 0; }
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

// The packed AVX2 path, for ranges of at least kPackTile tokens (prefill): the same FMAs per lane in the same
// order as Avx2Path's tiles, with the widening work moved out of the inner loop. A panel of tokens has its
// rounded activations widened once into the lane layout (per group of 32: the odd then the even elements of
// lanes 0-7, then of lanes 8-15, as f32), token tiles of kPackTile side by side per group so that a micro-tile
// reads one block at fixed offsets; fp8 weight rows are converted to bf16 groups once per block of
// kPackRowBlock rows and panel; a micro-tile is one weight row by up to kPackTile tokens, 12 accumulators.
constexpr int kPackTile = 6;
constexpr int64_t kPackMaxGroups = 256;                              // segments up to K = 8192
constexpr int64_t kPackPanelFloats = kPackTile * kPackMaxGroups * kDeviceGroup;  // 192 KiB of activations
constexpr int64_t kPackRowBlock = 16;

// The end of the chunk that starts at c0 (matmul.h step 1 of the device K loop).
MEMRA_SIMD int64_t chunk_end(bool e4m3, int64_t c0, int64_t k1) {
    return e4m3 ? std::min(k1, (c0 / kE4m3Group + 1) * kE4m3Group) : k1;
}

// The groups of 32 the device K loop reads over [k0, k1): a partial group ends each chunk that needs one.
MEMRA_SIMD int64_t device_groups(bool e4m3, int64_t k0, int64_t k1) {
    int64_t n = 0;
    for (int64_t c0 = k0; c0 < k1;) {
        const int64_t c1 = chunk_end(e4m3, c0, k1);
        n += (c1 - c0 + kDeviceGroup - 1) / kDeviceGroup;
        c0 = c1;
    }
    return n;
}

// Floats of one packed group of a token tile.
constexpr int64_t kPackGroupFloats = kPackTile * kDeviceGroup;

// One token's rounded row over [k0, k1) (x points at k0) in the lane layout, zero-padded groups: group g at
// out + g * kPackGroupFloats (out points at the token's place in its tile).
MEMRA_SIMD void pack_activations(const uint16_t *x, bool e4m3, int64_t k0, int64_t k1, float *out) {
    for (int64_t c0 = k0; c0 < k1;) {
        const int64_t c1 = chunk_end(e4m3, c0, k1);
        for (int64_t g = c0; g < c1; g += kDeviceGroup, out += kPackGroupFloats) {
            const Avx2Path::Group xg = Avx2Path::load_x(x + (g - k0), std::min(kDeviceGroup, c1 - g));
            _mm256_store_ps(out, Avx2Path::odd(xg.lo));
            _mm256_store_ps(out + 8, Avx2Path::even(xg.lo));
            _mm256_store_ps(out + 16, Avx2Path::odd(xg.hi));
            _mm256_store_ps(out + 24, Avx2Path::even(xg.hi));
        }
        c0 = c1;
    }
}

// One fp8 weight row's groups over [k0, k1) as bf16 bits, zero-padded groups.
MEMRA_SIMD void convert_fp8_row(const void *row, int64_t kb, bool e4m3, int64_t k0, int64_t k1, uint16_t *out) {
    for (int64_t c0 = k0; c0 < k1;) {
        const int64_t c1 = chunk_end(e4m3, c0, k1);
        for (int64_t g = c0; g < c1; g += kDeviceGroup, out += kDeviceGroup) {
            const Avx2Path::Group wg =
                Avx2Path::load_w<DType::kF8E4M3>(row, g - kb, std::min(kDeviceGroup, c1 - g));
            _mm256_store_si256(reinterpret_cast<__m256i *>(out), wg.lo);
            _mm256_store_si256(reinterpret_cast<__m256i *>(out + 16), wg.hi);
        }
        c0 = c1;
    }
}

// The device K loop of one weight row with kT packed tokens over [k0, k1): the weight groups come from `row`
// (bf16, kConverted false) or from `converted` (convert_fp8_row); xp is the token tile (pack_activations).
template <bool kConverted, int kT>
MEMRA_SIMD void packed_row(const void *row, const uint16_t *converted, int64_t kb, bool e4m3, const float *w_scales,
                           const float *xp, const float *const *sc, int64_t k0, int64_t k1, float *y,
                           int64_t y_stride) {
    float total[kT];
    for (int t = 0; t < kT; ++t) total[t] = 0.0f;
    int64_t gi = 0;
    for (int64_t c0 = k0; c0 < k1;) {
        const int64_t c1 = chunk_end(e4m3, c0, k1);
        __m256 lo[kT];
        __m256 hi[kT];
        for (int t = 0; t < kT; ++t) lo[t] = hi[t] = _mm256_setzero_ps();
        for (int64_t g = c0; g < c1; g += kDeviceGroup, ++gi) {
            Avx2Path::Group wg;
            if constexpr (kConverted) {
                wg = Avx2Path::load32(converted + gi * kDeviceGroup);
            } else {
                wg = Avx2Path::load_w<DType::kBF16>(row, g - kb, std::min(kDeviceGroup, c1 - g));
            }
            const float *xg = xp + gi * kPackGroupFloats;
            const __m256 w_odd_lo = Avx2Path::odd(wg.lo);
            const __m256 w_even_lo = Avx2Path::even(wg.lo);
            for (int t = 0; t < kT; ++t) {
                lo[t] = _mm256_fmadd_ps(_mm256_load_ps(xg + t * kDeviceGroup), w_odd_lo, lo[t]);
                lo[t] = _mm256_fmadd_ps(_mm256_load_ps(xg + t * kDeviceGroup + 8), w_even_lo, lo[t]);
            }
            const __m256 w_odd_hi = Avx2Path::odd(wg.hi);
            const __m256 w_even_hi = Avx2Path::even(wg.hi);
            for (int t = 0; t < kT; ++t) {
                hi[t] = _mm256_fmadd_ps(_mm256_load_ps(xg + t * kDeviceGroup + 16), w_odd_hi, hi[t]);
                hi[t] = _mm256_fmadd_ps(_mm256_load_ps(xg + t * kDeviceGroup + 24), w_even_hi, hi[t]);
            }
        }
        float sums[kT + 3];
        for (int t = 0; t < kT; t += 4) {
            // A last group of fewer than 4 repeats its first accumulator in the unused places.
            const int t1 = t + 1 < kT ? t + 1 : t;
            const int t2 = t + 2 < kT ? t + 2 : t;
            const int t3 = t + 3 < kT ? t + 3 : t;
            _mm_storeu_ps(sums + t, lane_sum16_x4(lo[t], hi[t], lo[t1], hi[t1], lo[t2], hi[t2], lo[t3], hi[t3]));
        }
        for (int t = 0; t < kT; ++t) {
            float chunk = sums[t];
            if (e4m3) {
                const int64_t ci = c0 / kE4m3Group;
                chunk = chunk * (sc[t][ci] * w_scales[ci]);
            }
            total[t] = total[t] + chunk;
        }
        c0 = c1;
    }
    for (int t = 0; t < kT; ++t) y[t * y_stride] = total[t];
}

template <bool kConverted>
MEMRA_SIMD void packed_row_tokens(int tt, const void *row, const uint16_t *converted, int64_t kb, bool e4m3,
                                  const float *w_scales, const float *xp, const float *const *sc, int64_t k0,
                                  int64_t k1, float *y, int64_t y_stride) {
    static_assert(kPackTile == 6);
    switch (tt) {
        case 6: packed_row<kConverted, 6>(row, converted, kb, e4m3, w_scales, xp, sc, k0, k1, y, y_stride); return;
        case 5: packed_row<kConverted, 5>(row, converted, kb, e4m3, w_scales, xp, sc, k0, k1, y, y_stride); return;
        case 4: packed_row<kConverted, 4>(row, converted, kb, e4m3, w_scales, xp, sc, k0, k1, y, y_stride); return;
        case 3: packed_row<kConverted, 3>(row, converted, kb, e4m3, w_scales, xp, sc, k0, k1, y, y_stride); return;
        case 2: packed_row<kConverted, 2>(row, converted, kb, e4m3, w_scales, xp, sc, k0, k1, y, y_stride); return;
        default: packed_row<kConverted, 1>(row, converted, kb, e4m3, w_scales, xp, sc, k0, k1, y, y_stride); return;
    }
}

// Whether the packed path takes rows x tokens [tb, te) of a task: enough tokens, and segments it can hold.
MEMRA_SIMD bool packed_takes(const Task &task, int64_t tb, int64_t te) {
    const bool e4m3 = task.w->act == ActRounding::kE4m3x128;
    return te - tb >= kPackTile && device_groups(e4m3, task.seg_k0, task.seg_k0 + task.seg_len) <= kPackMaxGroups;
}

// Rows [rb, re) x tokens [tb, te) of a device task on the packed path: for each segment, panels of tokens;
// for each panel, blocks of rows; for each block, micro-tiles of kPackTile tokens by each row.
template <DType kDt>
MEMRA_SIMD void packed_range(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    constexpr bool kConverted = kDt == DType::kF8E4M3;
    constexpr int64_t elem = kConverted ? 1 : 2;
    const WeightRef &w = *task.w;
    const bool e4m3 = w.act == ActRounding::kE4m3x128;
    const int64_t ld = weight_ld(w);
    const int64_t scale_cols = (weight_k_full(w) + w.block_cols - 1) / w.block_cols;
    alignas(32) float xp[kPackPanelFloats];
    alignas(32) uint16_t converted[kConverted ? kPackRowBlock * kPackMaxGroups * kDeviceGroup : 1];
    for (int64_t s = 0; s < task.n_segs; ++s) {
        const int64_t k0 = task.seg_k0 + s * task.seg_len;
        const int64_t k1 = k0 + task.seg_len;
        const int64_t groups = device_groups(e4m3, k0, k1);
        const int64_t tile_floats = groups * kPackGroupFloats;  // one packed token tile
        const int64_t panel = kPackPanelFloats / tile_floats * kPackTile;  // tokens a panel holds
        for (int64_t p0 = tb; p0 < te; p0 += panel) {
            const int64_t pn = std::min(panel, te - p0);
            for (int64_t t = 0; t < pn; ++t) {
                pack_activations(task.xq + (p0 + t) * task.x_stride + s * task.seg_len, e4m3, k0, k1,
                                 xp + (t / kPackTile) * tile_floats + (t % kPackTile) * kDeviceGroup);
            }
            for (int64_t r0 = rb; r0 < re; r0 += kPackRowBlock) {
                const int64_t r1 = std::min(re, r0 + kPackRowBlock);
                const auto row = [&](int64_t r) {
                    return static_cast<const uint8_t *>(w.data) + (task.n0 + r) * ld * elem;
                };
                const auto converted_row = [&](int64_t r) {
                    return kConverted ? converted + (r - r0) * groups * kDeviceGroup : nullptr;
                };
                if constexpr (kConverted) {
                    for (int64_t r = r0; r < r1; ++r) convert_fp8_row(row(r), w.k_begin, e4m3, k0, k1, converted_row(r));
                }
                for (int64_t t0 = 0; t0 < pn; t0 += kPackTile) {
                    const int tt = static_cast<int>(std::min<int64_t>(kPackTile, pn - t0));
                    const float *sc[kPackTile] = {};
                    if (e4m3) {
                        for (int i = 0; i < tt; ++i) sc[i] = task.xs + (p0 + t0 + i) * task.xs_stride;
                    }
                    const float *tile = xp + (t0 / kPackTile) * tile_floats;
                    for (int64_t r = r0; r < r1; ++r) {
                        const int64_t n = task.n0 + r;
                        const float *w_scales =
                            e4m3 ? w.scale_inv + ((w.row_offset + n) / w.block_rows) * scale_cols : nullptr;
                        float *y = task.y + s * task.seg_out_stride + (p0 + t0) * task.y_stride + r;
                        packed_row_tokens<kConverted>(tt, row(r), converted_row(r), w.k_begin, e4m3, w_scales, tile,
                                                      sc, k0, k1, y, task.y_stride);
                    }
                }
            }
        }
    }
}
// Activation rounding on AVX2, the same bits as round_row_portable (IEEE mode: no FTZ/DAZ here).

// The e4m3 value of f32_to_fp8_e4m3(v, saturate) as f32, for 8 values: NaN -> quiet NaN of its sign; above 464
// (and Inf) -> 448; below 2^-6 -> the nearest multiple of 2^-9 (ties to even, by adding and subtracting 2^14,
// whose ulp is 2^-9); otherwise 3 mantissa bits, ties to even.
MEMRA_SIMD __m256 e4m3_values8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7ffff)), lsb),
                                            _mm256_set1_epi32(static_cast<int>(0xfff00000u)));
    const __m256 magic = _mm256_set1_ps(16384.0f);
    const __m256i sub =
        _mm256_castps_si256(_mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(a), magic), magic));
    __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), a));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x43e00000), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43e80000)));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
    return _mm256_castsi256_ps(_mm256_or_si256(r, sign));
}

// Stores 16 bf16 codes: two vectors of 8, each code in the low half of a 32-bit lane.
MEMRA_SIMD void store_codes16(__m256i lo, __m256i hi, uint16_t *out) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), packed);
}

[[gnu::target("avx2,fma"), gnu::noinline]] void round_row_avx2(const float *x, int64_t k, ActRounding act,
                                                              uint16_t *codes, float *scales) {
    if (act == ActRounding::kBf16) {
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            store_codes16(_mm256_srli_epi32(_mm256_castps_si256(simd::round_bf16_8(_mm256_loadu_ps(x + i))), 16),
                          _mm256_srli_epi32(_mm256_castps_si256(simd::round_bf16_8(_mm256_loadu_ps(x + i + 8))), 16),
                          codes + i);
        }
        for (; i < k; ++i) codes[i] = f32_to_bf16(x[i]);
        return;
    }
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t g0 = 0; g0 < k; g0 += kE4m3Group) {
        const int64_t len = std::min(k - g0, kE4m3Group);
        alignas(32) float group[kE4m3Group] = {};  // zero-padded: |0| never raises the max
        std::memcpy(group, x + g0, static_cast<size_t>(len) * 4);
        // amax: vmaxps returns its second operand when the first is NaN, so a NaN never wins, and the max of
        // the remaining values does not depend on the order.
        __m256 m = _mm256_setzero_ps();
        for (int64_t i = 0; i < kE4m3Group; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_load_ps(group + i), abs_mask), m);
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, m);
        float amax = 0.0f;
        for (const float v : lanes) amax = v > amax ? v : amax;
        const float scale = e4m3_group_scale(amax);
        scales[g0 / kE4m3Group] = scale;
        const __m256 sv = _mm256_set1_ps(scale);
        alignas(32) uint16_t out[kE4m3Group];
        for (int64_t i = 0; i < kE4m3Group; i += 16) {
            const __m256 a = e4m3_values8(_mm256_div_ps(_mm256_load_ps(group + i), sv));
            const __m256 b = e4m3_values8(_mm256_div_ps(_mm256_load_ps(group + i + 8), sv));
            // The e4m3 values are bf16 values: their top halves are the codes.
            store_codes16(_mm256_srli_epi32(_mm256_castps_si256(a), 16), _mm256_srli_epi32(_mm256_castps_si256(b), 16),
                          out + i);
        }
        std::memcpy(codes + g0, out, static_cast<size_t>(len) * 2);
    }
}

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
            return e4m3_to_bf16(_mm256_maskz_loadu_epi8(tail_mask(n), static_cast<const uint8_t *>(row) + k));
        }
    }
    // 32 e4m3 codes -> 32 bf16 bit patterns (exact).
    MEMRA_SIMD static __m512i e4m3_to_bf16(__m256i bytes) {
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
    MEMRA_SIMD static void fma(Acc &acc, const Group &x, const Group &w) {
        acc = _mm512_dpbf16_ps(acc, vec_bits<__m512bh>(x), vec_bits<__m512bh>(w));
    }
    // The lane tree of matmul.h is a balanced tree of adjacent pairs, so 16 accumulators reduce together in
    // four levels of pair sums (15 of them instead of 16 trees): level 1 leaves the 8 pair sums of each
    // accumulator side by side, two accumulators per vector; each later level halves every accumulator's run;
    // after level 4 lane i holds accumulator i's sum.
    MEMRA_SIMD static void reduce(const Acc *acc, int n, float *out) {
        if (n == 16) {
            __m512 l1[8];
            for (int i = 0; i < 8; ++i) l1[i] = simd::pair_sums(acc[2 * i], acc[2 * i + 1]);
            __m512 l2[4];
            for (int i = 0; i < 4; ++i) l2[i] = simd::pair_sums(l1[2 * i], l1[2 * i + 1]);
            const __m512 l3a = simd::pair_sums(l2[0], l2[1]);
            const __m512 l3b = simd::pair_sums(l2[2], l2[3]);
            _mm512_storeu_ps(out, simd::pair_sums(l3a, l3b));
            return;
        }
        for (int a = 0; a < n; ++a) {
            alignas(64) float l[16];
            _mm512_store_ps(l, acc[a]);
            out[a] = lane_sum16(_mm256_load_ps(l), _mm256_load_ps(l + 8));
        }
    }
    // A tile of 16 / kT rows by kT tokens (kT = 4, 2, 1: 16 accumulators) with its epilogue in one vector: the
    // accumulators are kept token-major (lane kR t + r after the reduction), so the chunk's scale products, the
    // running totals and the stores of each token's kR rows are vector operations; the same operations, in the
    // same order, as device_tile's scalar epilogue (matmul_device_tile.inc), under the same MXCSR modes.
    static constexpr int vector_rows(int64_t tokens) { return tokens == 4 || tokens == 2 || tokens == 1 ? 16 / static_cast<int>(tokens) : 0; }
    template <DType kDt, int kT>
    MEMRA_SIMD static void vector_tile(const WeightRef &w, bool e4m3, int64_t n, const uint16_t *const *xs,
                                       const float *const *sc, int64_t k0, int64_t seg_len, int64_t n_segs,
                                       int64_t seg_out_stride, float *y, int64_t y_stride) {
        constexpr int kR = 16 / kT;
        static_assert(kR * kT == 16);
        constexpr int64_t elem = kDt == DType::kF8E4M3 ? 1 : 2;
        const int64_t kb = w.k_begin;
        const int64_t ld = weight_ld(w);
        const uint8_t *rows[kR];
        const float *scale_rows[kR] = {};
        const int64_t scale_cols = (weight_k_full(w) + w.block_cols - 1) / w.block_cols;
        for (int r = 0; r < kR; ++r) {
            rows[r] = static_cast<const uint8_t *>(w.data) + (n + r) * ld * elem;
            if (e4m3) scale_rows[r] = w.scale_inv + ((w.row_offset + n + r) / w.block_rows) * scale_cols;
        }
        for (int64_t seg = 0; seg < n_segs; ++seg, k0 += seg_len, y += seg_out_stride) {
            const int64_t k1 = k0 + seg_len;
            const int64_t x_off = seg * seg_len;
            __m512 total = _mm512_setzero_ps();
            for (int64_t c0 = k0; c0 < k1;) {
                const int64_t c1 = e4m3 ? std::min(k1, (c0 / kE4m3Group + 1) * kE4m3Group) : k1;
                Acc acc[16];  // acc[kR t + r]
                for (Acc &a : acc) a = zero();
                for (int64_t g = c0; g < c1; g += kDeviceGroup) {
                    const int64_t len = std::min(kDeviceGroup, c1 - g);
                    Group xg[kT];
                    for (int t = 0; t < kT; ++t) xg[t] = load_x(xs[t] + x_off + (g - k0), len);
                    for (int r = 0; r < kR; ++r) {
                        // The same place 4 tiles on (rows lie back to back): weights a few KiB ahead of the loads.
                        prefetch(rows[r] + (g - kb + 4 * kR * ld) * elem);
                        const Group wg = load_w<kDt>(rows[r], g - kb, len);
                        for (int t = 0; t < kT; ++t) fma(acc[kR * t + r], xg[t], wg);
                    }
                }
                alignas(64) float sums[16];
                reduce(acc, 16, sums);
                __m512 chunk = _mm512_load_ps(sums);
                if (e4m3) {
                    const int64_t ci = c0 / kE4m3Group;
                    alignas(64) float x_scale[16];
                    alignas(64) float w_scale[16];
                    for (int t = 0; t < kT; ++t) {
                        for (int r = 0; r < kR; ++r) {
                            x_scale[kR * t + r] = sc[t][ci];
                            w_scale[kR * t + r] = scale_rows[r][ci];
                        }
                    }
                    chunk = _mm512_mul_ps(chunk, _mm512_mul_ps(_mm512_load_ps(x_scale), _mm512_load_ps(w_scale)));
                }
                total = _mm512_add_ps(total, chunk);
                c0 = c1;
            }
            alignas(64) float out[16];
            _mm512_store_ps(out, total);
            for (int t = 0; t < kT; ++t) std::memcpy(y + t * y_stride, out + kR * t, sizeof(float) * kR);
        }
    }
};

namespace avx512 {
#include "backend/cpu/matmul_device_tile.inc"
}  // namespace avx512

// The device K loop over 16-row panels (WeightPanels): lanes are rows, so vdpbf16ps of a panel's pair p with
// token t's pair p broadcast to every lane computes lane j of the documented loop for 16 rows at once, and the
// lane tree of a chunk is vertical adds between those vectors (no shuffles): the same operations per row, in
// the same order, as device_tile. Lane j of a chunk is computed whole (its groups in order) before lane j + 1,
// and the tree is folded as the lanes arrive, so kT tokens need about 5 kT registers.
struct PanelTile {
    const void *panel;  // the 16-row panel
    int64_t k0;         // absolute K of the panel's pair 0
    const uint16_t *const *xs;
    int64_t x_base;     // K position of xs[t][0]
    int64_t c0, c1;     // the chunk

    template <DType kDt>
    MEMRA_SIMD __m512i pair(int64_t k) const {  // pair (k, k + 1) of the panel's 16 rows
        const int64_t p = (k - k0) / 2;
        if constexpr (kDt == DType::kBF16) {
            return _mm512_load_si512(static_cast<const uint16_t *>(panel) + p * 32);
        } else {
            return Avx512Bf16Path::e4m3_to_bf16(
                _mm256_load_si256(reinterpret_cast<const __m256i *>(static_cast<const uint8_t *>(panel) + p * 32)));
        }
    }
    // Lane j of the chunk for every token: groups from c0 in order; a pair past the chunk's end is the
    // zero padding of the documented loop (the same vdpbf16ps with zero operands).
    template <DType kDt, int kT, int J>
    MEMRA_SIMD void lane(__m512 *v) const {
        for (int t = 0; t < kT; ++t) v[t] = _mm512_setzero_ps();
        for (int64_t k = c0 + 2 * J; k < c1 + 2 * J; k += kDeviceGroup) {
            if (k < c1) {
                const __m512bh w = vec_bits<__m512bh>(pair<kDt>(k));
                for (int t = 0; t < kT; ++t) {
                    uint32_t xp;
                    std::memcpy(&xp, xs[t] + (k - x_base), sizeof(xp));
                    v[t] = _mm512_dpbf16_ps(v[t], w, vec_bits<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp))));
                }
            } else {
                const __m512bh z = vec_bits<__m512bh>(_mm512_setzero_si512());
                for (int t = 0; t < kT; ++t) v[t] = _mm512_dpbf16_ps(v[t], z, z);
            }
        }
    }
    // One token's 16 lanes side by side (16 independent chains: the decode case), group by group.
    template <DType kDt>
    MEMRA_SIMD void lanes(__m512 *v) const {
        for (int j = 0; j < 16; ++j) v[j] = _mm512_setzero_ps();
        const __m512bh z = vec_bits<__m512bh>(_mm512_setzero_si512());
        for (int64_t g = c0; g < c1; g += kDeviceGroup) {
            const bool whole = g + kDeviceGroup <= c1;
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
                const int64_t k = g + 2 * j;
                if (whole || k < c1) {
                    uint32_t xp;
                    std::memcpy(&xp, xs[0] + (k - x_base), sizeof(xp));
                    v[j] = _mm512_dpbf16_ps(v[j], vec_bits<__m512bh>(pair<kDt>(k)),
                                            vec_bits<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp))));
                } else {
                    v[j] = _mm512_dpbf16_ps(v[j], z, z);
                }
            }
        }
    }
    // The lane tree over lanes [J, J + N): ((l0 + l1) + (l2 + l3)) + ... for every token; one token's lanes
    // come whole from lanes() (`all`), more tokens' lane by lane.
    template <DType kDt, int kT, int J, int N>
    MEMRA_SIMD void tree(__m512 *out, const __m512 *all = nullptr) const {
        if constexpr (N == 16 && kT == 1) {
            if (all == nullptr) {
                __m512 v[16];
                lanes<kDt>(v);
                tree<kDt, 1, 0, 16>(out, v);
                return;
            }
        }
        if constexpr (N == 1) {
            if (all != nullptr) {
                out[0] = all[J];
            } else {
                lane<kDt, kT, J>(out);
            }
        } else {
            __m512 b[kT];
            tree<kDt, kT, J, N / 2>(out, all);
            tree<kDt, kT, J + N / 2, N / 2>(b, all);
            for (int t = 0; t < kT; ++t) out[t] = _mm512_add_ps(out[t], b[t]);
        }
    }
};

// 16 panel rows from row n (task-relative rows r .. r + 15, y at their first output) by kT tokens, every segment.
template <DType kDt, int kT>
MEMRA_SIMD void panel_tile(const Task &task, bool e4m3, int64_t n, const uint16_t *const *xs, const float *const *sc,
                           float *y) {
    const WeightRef &w = *task.w;
    const WeightPanels &pn = w.panels;
    constexpr int64_t elem = kDt == DType::kF8E4M3 ? 1 : 2;
    PanelTile tile{static_cast<const uint8_t *>(pn.data) + (n / 16) * pn.pairs * 32 * elem, pn.k0, xs, 0, 0, 0};
    const int64_t scale_cols = (weight_k_full(w) + w.block_cols - 1) / w.block_cols;
    int64_t k0 = task.seg_k0;
    for (int64_t seg = 0; seg < task.n_segs; ++seg, k0 += task.seg_len, y += task.seg_out_stride) {
        const int64_t k1 = k0 + task.seg_len;
        tile.x_base = k0 - seg * task.seg_len;  // xs[t] points at the task's first K position
        __m512 total[kT];
        for (int t = 0; t < kT; ++t) total[t] = _mm512_setzero_ps();
        for (int64_t c0 = k0; c0 < k1;) {
            const int64_t c1 = e4m3 ? std::min(k1, (c0 / kE4m3Group + 1) * kE4m3Group) : k1;
            tile.c0 = c0;
            tile.c1 = c1;
            __m512 chunk[kT];
            tile.tree<kDt, kT, 0, 16>(chunk);
            if (e4m3) {
                const int64_t ci = c0 / kE4m3Group;
                alignas(64) float ws[16];
                for (int r = 0; r < 16; ++r) ws[r] = w.scale_inv[((w.row_offset + n + r) / w.block_rows) * scale_cols + ci];
                const __m512 wsv = _mm512_load_ps(ws);
                for (int t = 0; t < kT; ++t) {
                    chunk[t] = _mm512_mul_ps(chunk[t], _mm512_mul_ps(_mm512_set1_ps(sc[t][ci]), wsv));
                }
            }
            for (int t = 0; t < kT; ++t) total[t] = _mm512_add_ps(total[t], chunk[t]);
            c0 = c1;
        }
        for (int t = 0; t < kT; ++t) _mm512_storeu_ps(y + t * task.y_stride, total[t]);
    }
}

// Whether a task's chunks all start on an even K inside w's panels (then every pair it reads is a panel pair).
MEMRA_SIMD bool panels_take(const Task &task) {
    const WeightPanels &pn = task.w->panels;
    return pn.data != nullptr && task.seg_k0 % 2 == 0 && task.seg_len % 2 == 0 && task.seg_k0 >= pn.k0 &&
           task.seg_k0 + task.n_segs * task.seg_len <= pn.k0 + 2 * pn.pairs;
}

// Rows [rb, rb + 16 m) x tokens [tb, te) of a task whose rows there are whole panels: tokens 4, then 2, then 1 at
// a time, panel by panel.
template <DType kDt>
MEMRA_SIMD void panel_rows(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    const bool e4m3 = task.w->act == ActRounding::kE4m3x128;
    for (int64_t r = rb; r < re; r += 16) {
        int64_t tt = 0;
        for (int64_t t = tb; t < te; t += tt) {
            tt = te - t >= 4 ? 4 : (te - t >= 2 ? 2 : 1);
            const uint16_t *xs[4];
            const float *sc[4] = {};
            for (int64_t i = 0; i < tt; ++i) {
                xs[i] = task.xq + (t + i) * task.x_stride;
                if (e4m3) sc[i] = task.xs + (t + i) * task.xs_stride;
            }
            float *y = task.y + t * task.y_stride + r;
            const int64_t n = task.n0 + r;
            if (tt == 4) {
                panel_tile<kDt, 4>(task, e4m3, n, xs, sc, y);
            } else if (tt == 2) {
                panel_tile<kDt, 2>(task, e4m3, n, xs, sc, y);
            } else {
                panel_tile<kDt, 1>(task, e4m3, n, xs, sc, y);
            }
        }
    }
}

// Rows [rb, re) x tokens [tb, te) on the AVX512-BF16 path: the panel rows through panel_rows, the rest (rows
// before the first whole panel, after the last, weights without panels) through the tiles.
template <DType kDt>
MEMRA_SIMD void avx512_range(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    int64_t pb = re;
    int64_t pe = re;
    if (panels_take(task)) {
        // Task rows [pb, pe): whole panels (weight rows n0 + r, aligned to 16) inside [rb, re).
        pb = std::min(re, (task.n0 + rb + 15) / 16 * 16 - task.n0);
        pe = std::max(pb, std::min(re, task.w->panels.rows - task.n0));
        pe = pb + (pe - pb) / 16 * 16;
    }
    if (rb < pb) avx512::device_range<Avx512Bf16Path, kDt>(task, rb, pb, tb, te);
    if (pb < pe) panel_rows<kDt>(task, pb, pe, tb, te);
    if (pe < re) avx512::device_range<Avx512Bf16Path, kDt>(task, pe, re, tb, te);
}
#pragma GCC pop_options
#undef MEMRA_SIMD
#endif

// One row of round_activations in scalar code: the definition (device_numerics.h, float_formats.h).
void round_row_portable(const float *x, int64_t k, ActRounding act, uint16_t *codes, float *scales) {
    if (act == ActRounding::kBf16) {
        for (int64_t i = 0; i < k; ++i) codes[i] = f32_to_bf16(x[i]);
        return;
    }
    float values[kE4m3Group];
    for (int64_t g0 = 0; g0 < k; g0 += kE4m3Group) {
        const int64_t len = std::min(k - g0, kE4m3Group);
        scales[g0 / kE4m3Group] = e4m3_quantize_group(x + g0, len, values);
        // Exact: every e4m3 value is a bf16 value.
        for (int64_t i = 0; i < len; ++i) codes[g0 + i] = f32_to_bf16(values[i]);
    }
}

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
    const bool packed = packed_takes(task, tb, te);
    if (task.w->dtype == DType::kBF16) {
        if (packed) {
            packed_range<DType::kBF16>(task, rb, re, tb, te);
        } else {
            avx2::device_range<Avx2Path, DType::kBF16>(task, rb, re, tb, te);
        }
    } else if (packed) {
        packed_range<DType::kF8E4M3>(task, rb, re, tb, te);
    } else {
        avx2::device_range<Avx2Path, DType::kF8E4M3>(task, rb, re, tb, te);
    }
}

[[gnu::target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16"), gnu::noinline]] void run_avx512bf16(const Task &task,
                                                                                          int64_t rb, int64_t re,
                                                                                          int64_t tb, int64_t te) {
    if (task.w->dtype == DType::kBF16) {
        avx512_range<DType::kBF16>(task, rb, re, tb, te);
    } else {
        avx512_range<DType::kF8E4M3>(task, rb, re, tb, te);
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

void round_row(const float *x, int64_t k, ActRounding act, uint16_t *codes, float *scales) {
#if MEMRA_X86
    if (product_isa() != ProductIsa::kPortable) {
        round_row_avx2(x, k, act, codes, scales);
        return;
    }
#endif
    round_row_portable(x, k, act, codes, scales);
}

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

// ---------------------------------------------------------------------------------------------
// 16-row panels (matmul.h WeightPanels).

namespace {

constexpr int64_t kPanelRows = 16;

// w's panels as WeightPanels at `data`: none for a weight the device K loop does not read, fewer than 16 rows, or
// an odd K start or width.
WeightPanels panel_shape(const WeightRef &w, const void *data) {
    const bool device = (w.act == ActRounding::kBf16 && w.dtype == DType::kBF16) ||
                        (w.act == ActRounding::kE4m3x128 && w.dtype == DType::kF8E4M3);
    if (!device || w.rows < kPanelRows || w.k_begin % 2 != 0 || w.cols % 2 != 0 || w.cols == 0) return {};
    return WeightPanels{data, w.rows / kPanelRows * kPanelRows, w.k_begin, w.cols / 2};
}

}  // namespace

int64_t device_panels_bytes(const WeightRef &w) {
    const WeightPanels s = panel_shape(w, nullptr);
    return s.rows * s.pairs * 2 * static_cast<int64_t>(dtype_size(w.dtype));
}

WeightRef device_panels_fill(ThreadPool &pool, const WeightRef &w, void *dst) {
    const WeightPanels s = panel_shape(w, dst);
    if (s.rows == 0) return w;
    MEMRA_CHECK(reinterpret_cast<uintptr_t>(dst) % 64 == 0, "device panels: the destination is not 64-byte aligned");
    const int64_t elem = static_cast<int64_t>(dtype_size(w.dtype));
    const int64_t ld = weight_ld(w) * elem;
    const auto *src = static_cast<const uint8_t *>(w.data);
    pool.parallel_for(s.rows / kPanelRows, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            auto *out = static_cast<uint8_t *>(dst) + b * s.pairs * kPanelRows * 2 * elem;
            for (int64_t p = 0; p < s.pairs; ++p) {
                for (int64_t r = 0; r < kPanelRows; ++r, out += 2 * elem) {
                    std::memcpy(out, src + (b * kPanelRows + r) * ld + 2 * p * elem, static_cast<size_t>(2 * elem));
                }
            }
        }
    });
    WeightRef p = w;
    p.panels = s;
    return p;
}

WeightBankRef device_panels_fill(ThreadPool &pool, const WeightBankRef &bank, void *dst) {
    WeightBankRef plain = bank;
    plain.panels = nullptr;
    const int64_t bytes = device_panels_bytes(weight_bank_expert(plain, 0));
    if (bytes == 0) return plain;
    for (int64_t e = 0; e < bank.n_experts; ++e) {
        device_panels_fill(pool, weight_bank_expert(plain, e), static_cast<uint8_t *>(dst) + e * bytes);
    }
    plain.panels = dst;
    return plain;
}

WeightPanels device_panels_at(const WeightRef &w, const void *data) { return panel_shape(w, data); }

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
