// Paged attention on the CPU, in the two-pass exact order and the blocked device order, and the KV write
// (see ops_attention.h).
#include "backend/cpu/ops_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops_common.h"
#include "backend/cpu/simd_avx2.h"
#include "core/check.h"
#include "core/math.h"

namespace memra::cpu {
namespace {

// Query heads one work item serves together, and the pass-1 scores each keeps for pass 2 (positions past
// it are scored again: the same bits). Stack: 8 * 2048 scores + 8 * 512 accumulators, ~80 KiB.
constexpr int64_t kHeadBatch = 8;
constexpr int64_t kScoreCache = 2048;
constexpr int64_t kMaxHeadDim = 512;

// The blocked (device) order: blocks of 128 positions and splits of 512, both aligned to position 0. A work
// item keeps its q rows, a chunk of decoded keys or values, the scores of one split and its accumulators: 8 * 512
// floats each, 64 KiB of stack.
constexpr int64_t kBlockRows = 128;
constexpr int64_t kSplitRows = 512;
constexpr int64_t kKeyChunk = 8;  // keys scored by one call of Ops::score
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Work items (a query's head batch) a thread claims at a time: their costs grow with the query's position, so
// the threads claim them in turn (parallel_for_dynamic) rather than split them in equal contiguous halves.
constexpr int64_t kItemGrain = 4;
// Queries of one sequence that share decoded keys and values in the blocked order (a prefill's neighbouring rows).
constexpr int64_t kQueryRun = 4;

float round_to_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// The inner operations of the blocked order on one instruction path; the loops around them are shared
// (paged_attention). Every path gives the bits of the scalar spelling below, which is the reference:
//   round_bf16  x[d] = round_to_bf16(x[d]), d < n
//   decode      kv_decode(format, in, n, y), then round_bf16(y, n) when `round`
//   score       scores[j][at + c] = dot_f32(qbuf[j], keys[c], head_dim) * scale, j < nh, c < n (<= kKeyChunk);
//               qbuf and keys rows are +0 from head_dim to the next multiple of 16
//   block_max   bm = -inf, then bm = s[p] > bm ? s[p] : bm for p < n increasing (a NaN is skipped)
//   exp_sums    for live heads j: s[p] = exp_f32(s[p] - m_new[j]) and b_sum[j] = +0 + s[0] + s[1] + ... in
//               increasing p, over s = scores[j] + at, p < n
//   add_values  for c < n (<= kKeyChunk), then the live heads j: acc[j][d] = acc[j][d] + round_to_bf16(scores[j]
//               [at + c]) * rows[c][d], d < head_dim
struct BlockedPortable {
    static void round_bf16(float *x, int64_t n) {
        for (int64_t d = 0; d < n; ++d) x[d] = round_to_bf16(x[d]);
    }
    static void decode(KvFormat format, const std::byte *in, int64_t n, bool round, float *y) {
        kv_decode(format, in, n, y);
        if (round) round_bf16(y, n);
    }
    static void score(const float (*qbuf)[kMaxHeadDim], int64_t nh, const float (*keys)[kMaxHeadDim], int64_t n,
                      int64_t head_dim, float scale, float (*scores)[kSplitRows], int64_t at) {
        for (int64_t c = 0; c < n; ++c) {
            for (int64_t j = 0; j < nh; ++j) scores[j][at + c] = dot_f32(qbuf[j], keys[c], head_dim) * scale;
        }
    }
    static float block_max(const float *s, int64_t n) {
        float bm = kNegInf;
        for (int64_t p = 0; p < n; ++p) bm = s[p] > bm ? s[p] : bm;
        return bm;
    }
    static void exp_sums(float (*scores)[kSplitRows], int64_t at, int64_t n, int64_t nh, const bool *live,
                         const float *m_new, float *b_sum) {
        for (int64_t j = 0; j < nh; ++j) {
            if (!live[j]) continue;
            float *sj = scores[j] + at;
            float sum = 0.0f;
            for (int64_t p = 0; p < n; ++p) {
                sj[p] = exp_f32(sj[p] - m_new[j]);
                sum = sum + sj[p];
            }
            b_sum[j] = sum;
        }
    }
    static void add_values(float (*acc)[kMaxHeadDim], const float (*scores)[kSplitRows], int64_t at, int64_t n,
                           int64_t nh, const bool *live, const float (*rows)[kMaxHeadDim], int64_t head_dim) {
        for (int64_t c = 0; c < n; ++c) {
            for (int64_t j = 0; j < nh; ++j) {
                if (!live[j]) continue;
                const float pw = round_to_bf16(scores[j][at + c]);
                float *aj = acc[j];
                for (int64_t d = 0; d < head_dim; ++d) aj[d] = aj[d] + pw * rows[c][d];
            }
        }
    }
};

#if MEMRA_X86
#pragma GCC push_options
#pragma GCC target("avx2")
#define MEMRA_LANES [[gnu::always_inline]] inline
using simd::exp_8;
using simd::round_bf16_8;
// The same operations in 8 AVX2 lanes, each lane performing the scalar operations of its value in the scalar
// order: _mm256_mul_ps then _mm256_add_ps for every a * b + c (no FMA), no MXCSR change (no FTZ/DAZ), and only
// the exact integer steps of the bit-level functions. A scalar tail handles what does not fill 8 lanes.

// round_bf16_8 of values that are bf16 already: only a NaN changes (to the quiet NaN with its sign).
MEMRA_LANES __m256 round_bf16_8_of_bf16(__m256 x) {
    const __m256 quiet = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)),
                                      _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    return _mm256_blendv_ps(x, quiet, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// [x0 + x1, x2 + x3, y0 + y1, y2 + y3 | x4 + x5, x6 + x7, y4 + y5, y6 + y7]
MEMRA_LANES __m256 add_pairs(__m256 x, __m256 y) {
    return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane k of the result: the first three levels of the lane tree (core/math.h reduce_lanes_tree),
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), over the lanes l0..l7 of a[k].
MEMRA_LANES __m256 tree_8x8(const __m256 (&a)[kKeyChunk]) {
    // t0 = [a0:0123 a1:0123 a2:0123 a3:0123 | a0:4567 .. a3:4567] with a:0123 = (l0 + l1) + (l2 + l3) of a and
    // a:4567 = (l4 + l5) + (l6 + l7); t1 likewise for a4..a7.
    const __m256 t0 = add_pairs(add_pairs(a[0], a[1]), add_pairs(a[2], a[3]));
    const __m256 t1 = add_pairs(add_pairs(a[4], a[5]), add_pairs(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

struct BlockedAvx2 {
    static void round_bf16(float *x, int64_t n) {
        int64_t d = 0;
        for (; d + 8 <= n; d += 8) _mm256_storeu_ps(x + d, round_bf16_8(_mm256_loadu_ps(x + d)));
        for (; d < n; ++d) x[d] = round_to_bf16(x[d]);
    }
    // f32 and bf16 rows are widened and rounded 8 values at a time (kv_decode takes the tail); the block formats
    // are decoded by kv_decode.
    static void decode(KvFormat format, const std::byte *in, int64_t n, bool round, float *y) {
        int64_t d = 0;
        if (format == KvFormat::kF32 || format == KvFormat::kBf16) {
            const bool f32 = format == KvFormat::kF32;
            for (; d + 8 <= n; d += 8) {
                if (f32) {
                    const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float *>(in + 4 * d));
                    _mm256_storeu_ps(y + d, round ? round_bf16_8(x) : x);
                } else {
                    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(in + 2 * d));
                    const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                    _mm256_storeu_ps(y + d, round ? round_bf16_8_of_bf16(x) : x);
                }
            }
            if (d < n) kv_decode(format, in + (f32 ? 4 : 2) * d, n - d, y + d);
        } else {
            kv_decode(format, in, n, y);
        }
        if (round) round_bf16(y + d, n - d);
    }
    // The 16 dot lanes of one q row against kKeyChunk keys, as lanes 0..7 (h = 0) and 8..15 (h = 1) in two
    // passes of 8 accumulators, key c in a[c]; then the tree's first three levels over each half and its last
    // add, (lanes 0..7) + (lanes 8..15). Keys past n are computed from the other rows and dropped.
    static void score(const float (*qbuf)[kMaxHeadDim], int64_t nh, const float (*keys)[kMaxHeadDim], int64_t n,
                      int64_t head_dim, float scale, float (*scores)[kSplitRows], int64_t at) {
        const int64_t padded = (head_dim + kReduceLanes - 1) / kReduceLanes * kReduceLanes;
        for (int64_t j = 0; j < nh; ++j) {
            __m256 half[2];
            for (int h = 0; h < 2; ++h) {
                __m256 a[kKeyChunk];
#pragma GCC unroll 8
                for (int c = 0; c < kKeyChunk; ++c) a[c] = _mm256_setzero_ps();
                for (int64_t d = 8 * h; d < padded; d += kReduceLanes) {
                    const __m256 qv = _mm256_load_ps(qbuf[j] + d);
#pragma GCC unroll 8
                    for (int c = 0; c < kKeyChunk; ++c) {
                        a[c] = _mm256_add_ps(a[c], _mm256_mul_ps(qv, _mm256_load_ps(keys[c] + d)));
                    }
                }
                half[h] = tree_8x8(a);
            }
            const __m256 s = _mm256_mul_ps(_mm256_add_ps(half[0], half[1]), _mm256_set1_ps(scale));
            if (n == kKeyChunk) {
                _mm256_storeu_ps(scores[j] + at, s);
            } else {
                alignas(32) float tmp[kKeyChunk];
                _mm256_store_ps(tmp, s);
                std::copy(tmp, tmp + n, scores[j] + at);
            }
        }
    }
    // The max of a set of non-NaN floats is one value, whatever the order in which `>` visits it, and every value
    // has one encoding but zero: so 8 lanes with vmaxps (vmaxps(s, m) is s > m ? s : m, NaN s keeps m) give the
    // scalar result unless the max is a zero, for which the scalar loop decides the sign (the first zero seen).
    static float block_max(const float *s, int64_t n) {
        if (n < 8) return BlockedPortable::block_max(s, n);
        __m256 vm = _mm256_set1_ps(kNegInf);
        int64_t p = 0;
        for (; p + 8 <= n; p += 8) vm = _mm256_max_ps(_mm256_loadu_ps(s + p), vm);
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, vm);
        float bm = BlockedPortable::block_max(lanes, 8);
        for (; p < n; ++p) bm = s[p] > bm ? s[p] : bm;
        return bm == 0.0f ? BlockedPortable::block_max(s, n) : bm;
    }
    // The exps 8 positions at a time; then each head's sum in increasing p, the heads side by side: 8 x 8 tiles
    // of e are transposed so that column p holds e_p of every head (lane j = head j), added to the running sums
    // in order. Lanes of heads that are not live or past nh add rows that are not used.
    static void exp_sums(float (*scores)[kSplitRows], int64_t at, int64_t n, int64_t nh, const bool *live,
                         const float *m_new, float *b_sum) {
        for (int64_t j = 0; j < nh; ++j) {
            if (!live[j]) continue;
            float *sj = scores[j] + at;
            const __m256 mj = _mm256_set1_ps(m_new[j]);
            int64_t p = 0;
            for (; p + 8 <= n; p += 8) {
                _mm256_storeu_ps(sj + p, exp_8(_mm256_sub_ps(_mm256_loadu_ps(sj + p), mj)));
            }
            for (; p < n; ++p) sj[p] = exp_f32(sj[p] - m_new[j]);
        }
        __m256 sum = _mm256_setzero_ps();
        int64_t p = 0;
        for (; p + 8 <= n; p += 8) {
            __m256 r[8];
            for (int64_t j = 0; j < 8; ++j) {
                r[j] = j < nh ? _mm256_loadu_ps(scores[j] + at + p) : _mm256_setzero_ps();
            }
            // 8 x 8 transpose: r[j] lane c = e of head j at p + c  ->  col[c] lane j.
            const __m256 u0 = _mm256_unpacklo_ps(r[0], r[1]), u1 = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 u2 = _mm256_unpacklo_ps(r[2], r[3]), u3 = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 u4 = _mm256_unpacklo_ps(r[4], r[5]), u5 = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 u6 = _mm256_unpacklo_ps(r[6], r[7]), u7 = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 v0 = _mm256_shuffle_ps(u0, u2, _MM_SHUFFLE(1, 0, 1, 0));
            const __m256 v1 = _mm256_shuffle_ps(u0, u2, _MM_SHUFFLE(3, 2, 3, 2));
            const __m256 v2 = _mm256_shuffle_ps(u1, u3, _MM_SHUFFLE(1, 0, 1, 0));
            const __m256 v3 = _mm256_shuffle_ps(u1, u3, _MM_SHUFFLE(3, 2, 3, 2));
            const __m256 v4 = _mm256_shuffle_ps(u4, u6, _MM_SHUFFLE(1, 0, 1, 0));
            const __m256 v5 = _mm256_shuffle_ps(u4, u6, _MM_SHUFFLE(3, 2, 3, 2));
            const __m256 v6 = _mm256_shuffle_ps(u5, u7, _MM_SHUFFLE(1, 0, 1, 0));
            const __m256 v7 = _mm256_shuffle_ps(u5, u7, _MM_SHUFFLE(3, 2, 3, 2));
            const __m256 col[8] = {
                _mm256_permute2f128_ps(v0, v4, 0x20), _mm256_permute2f128_ps(v1, v5, 0x20),
                _mm256_permute2f128_ps(v2, v6, 0x20), _mm256_permute2f128_ps(v3, v7, 0x20),
                _mm256_permute2f128_ps(v0, v4, 0x31), _mm256_permute2f128_ps(v1, v5, 0x31),
                _mm256_permute2f128_ps(v2, v6, 0x31), _mm256_permute2f128_ps(v3, v7, 0x31)};
            for (const __m256 &cp : col) sum = _mm256_add_ps(sum, cp);
        }
        alignas(32) float sums[8];
        _mm256_store_ps(sums, sum);
        for (int64_t j = 0; j < nh; ++j) {
            if (!live[j]) continue;
            float s = sums[j];
            for (int64_t t = p; t < n; ++t) s = s + scores[j][at + t];
            b_sum[j] = s;
        }
    }
    // Each head's accumulators 8 at a time, through the n values in order (a full chunk unrolled).
    static void add_values(float (*acc)[kMaxHeadDim], const float (*scores)[kSplitRows], int64_t at, int64_t n,
                           int64_t nh, const bool *live, const float (*rows)[kMaxHeadDim], int64_t head_dim) {
        for (int64_t j = 0; j < nh; ++j) {
            if (!live[j]) continue;
            float pw[kKeyChunk];
            __m256 pv[kKeyChunk];
            for (int64_t c = 0; c < n; ++c) {
                pw[c] = round_to_bf16(scores[j][at + c]);
                pv[c] = _mm256_set1_ps(pw[c]);
            }
            float *aj = acc[j];
            int64_t d = 0;
            for (; d + 8 <= head_dim; d += 8) {
                __m256 a = _mm256_load_ps(aj + d);
                if (n == kKeyChunk) {
#pragma GCC unroll 8
                    for (int c = 0; c < kKeyChunk; ++c) {
                        a = _mm256_add_ps(a, _mm256_mul_ps(pv[c], _mm256_load_ps(rows[c] + d)));
                    }
                } else {
                    for (int64_t c = 0; c < n; ++c) {
                        a = _mm256_add_ps(a, _mm256_mul_ps(pv[c], _mm256_load_ps(rows[c] + d)));
                    }
                }
                _mm256_store_ps(aj + d, a);
            }
            for (; d < head_dim; ++d) {
                for (int64_t c = 0; c < n; ++c) aj[d] = aj[d] + pw[c] * rows[c][d];
            }
        }
    }
    static void exp_rows(const float *x, int64_t n, float *y) {
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp_8(_mm256_loadu_ps(x + i)));
        for (; i < n; ++i) y[i] = exp_f32(x[i]);
    }
};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avx512f")
// The dot products and value chains in 16 AVX-512 lanes; the rest as BlockedAvx2. Still no FMA and no MXCSR
// change: each lane performs its value's scalar operations in the scalar order.
struct BlockedAvx512 : BlockedAvx2 {
    // One zmm per key holds all 16 dot lanes; the 8 keys' lane trees (a balanced tree of adjacent pairs) run
    // together as levels of pair sums: after three levels lanes 2c and 2c + 1 hold key c's sums over lanes 0..7
    // and 8..15, and a last level adds those two.
    static void score(const float (*qbuf)[kMaxHeadDim], int64_t nh, const float (*keys)[kMaxHeadDim], int64_t n,
                      int64_t head_dim, float scale, float (*scores)[kSplitRows], int64_t at) {
        const int64_t padded = (head_dim + kReduceLanes - 1) / kReduceLanes * kReduceLanes;
        for (int64_t j = 0; j < nh; ++j) {
            __m512 a[kKeyChunk];
#pragma GCC unroll 8
            for (int c = 0; c < kKeyChunk; ++c) a[c] = _mm512_setzero_ps();
            for (int64_t d = 0; d < padded; d += kReduceLanes) {
                const __m512 qv = _mm512_loadu_ps(qbuf[j] + d);
#pragma GCC unroll 8
                for (int c = 0; c < kKeyChunk; ++c) {
                    a[c] = _mm512_add_ps(a[c], _mm512_mul_ps(qv, _mm512_loadu_ps(keys[c] + d)));
                }
            }
            const __m512 l1a = simd::pair_sums(a[0], a[1]);
            const __m512 l1b = simd::pair_sums(a[2], a[3]);
            const __m512 l1c = simd::pair_sums(a[4], a[5]);
            const __m512 l1d = simd::pair_sums(a[6], a[7]);
            const __m512 l3 = simd::pair_sums(simd::pair_sums(l1a, l1b), simd::pair_sums(l1c, l1d));
            const __m512 sums = simd::pair_sums(l3, _mm512_setzero_ps());  // lanes 0..7: the keys' sums
            alignas(64) float tmp[16];
            _mm512_store_ps(tmp, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
            std::copy(tmp, tmp + n, scores[j] + at);
        }
    }
    // Each head's accumulators 16 at a time, through the n values in order; the 8-lane and scalar tails as
    // BlockedAvx2 runs them.
    static void add_values(float (*acc)[kMaxHeadDim], const float (*scores)[kSplitRows], int64_t at, int64_t n,
                           int64_t nh, const bool *live, const float (*rows)[kMaxHeadDim], int64_t head_dim) {
        const int64_t wide = head_dim / 16 * 16;
        for (int64_t j = 0; j < nh; ++j) {
            if (!live[j]) continue;
            __m512 pv[kKeyChunk];
            for (int64_t c = 0; c < n; ++c) pv[c] = _mm512_set1_ps(round_to_bf16(scores[j][at + c]));
            float *aj = acc[j];
            for (int64_t d = 0; d < wide; d += 16) {
                __m512 a = _mm512_loadu_ps(aj + d);
                if (n == kKeyChunk) {
#pragma GCC unroll 8
                    for (int c = 0; c < kKeyChunk; ++c) {
                        a = _mm512_add_ps(a, _mm512_mul_ps(pv[c], _mm512_loadu_ps(rows[c] + d)));
                    }
                } else {
                    for (int64_t c = 0; c < n; ++c) {
                        a = _mm512_add_ps(a, _mm512_mul_ps(pv[c], _mm512_loadu_ps(rows[c] + d)));
                    }
                }
                _mm512_storeu_ps(aj + d, a);
            }
            for (int64_t d = wide; d < head_dim; ++d) {
                for (int64_t c = 0; c < n; ++c) aj[d] = aj[d] + round_to_bf16(scores[j][at + c]) * rows[c][d];
            }
        }
    }
};
#undef MEMRA_LANES
#pragma GCC pop_options
#endif

}  // namespace

float attention_scale(int64_t head_dim) {
    MEMRA_CHECK(head_dim > 0, "attention_scale: head_dim must be > 0, got {}", head_dim);
    return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

void blocked_exp_f32(const float *x, int64_t n, float *y) {
#if MEMRA_X86
    if (product_isa() != ProductIsa::kPortable) {
        BlockedAvx2::exp_rows(x, n, y);
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) y[i] = exp_f32(x[i]);
}

void blocked_round_bf16(const float *x, int64_t n, float *y) {
    if (y != x) std::copy(x, x + n, y);
#if MEMRA_X86
    if (product_isa() != ProductIsa::kPortable) {
        BlockedAvx2::round_bf16(y, n);
        return;
    }
#endif
    BlockedPortable::round_bf16(y, n);
}

void kv_write(ThreadPool &pool, const PagedLayer &layer, int64_t row_elems, const float *k, const float *v,
              const int32_t *slots, int64_t n) {
    MEMRA_CHECK(row_elems > 0 && n >= 0, "kv_write: {} rows of {} values", n, row_elems);
    detail::parallel_rows(pool, n, row_elems * 4, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t slot = slots[i];
            MEMRA_CHECK(slot >= 0 && slot < layer.n_pages * kKvPageRows, "kv_write: row {} has slot {} of {}", i,
                        slot, layer.n_pages * kKvPageRows);
            std::byte *page = layer.base + (slot / kKvPageRows) * layer.page_bytes;
            const int64_t r = slot % kKvPageRows;
            kv_encode(layer.k_format, k + i * row_elems, row_elems, page + layer.k_offset + r * layer.k_row_bytes);
            kv_encode(layer.v_format, v + i * row_elems, row_elems, page + layer.v_offset + r * layer.v_row_bytes);
        }
    });
}

void paged_attention(ThreadPool &pool, const AttentionShape &shape, const float *q, int64_t q_stride,
                     const int64_t *q_pos, const int32_t *q_seq, int64_t n_q, const PagedLayer &layer,
                     const int32_t *block_tables, int64_t bt_stride, int64_t n_seqs, int64_t first_pos,
                     const float *gate, int64_t gate_stride, float *out) {
    const int64_t n_heads = shape.n_heads;
    const int64_t n_kv_heads = shape.n_kv_heads;
    const int64_t head_dim = shape.head_dim;
    MEMRA_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0 &&
                    head_dim <= kMaxHeadDim && shape.window >= 0 && first_pos >= 0,
                "paged_attention: bad shape heads {} kv_heads {} head_dim {} window {} first_pos {}", n_heads,
                n_kv_heads, head_dim, shape.window, first_pos);
    MEMRA_CHECK(q_stride >= n_heads * head_dim && n_q >= 0 && bt_stride >= 1 && n_seqs >= 1,
                "paged_attention: bad q_stride {} / n_q {} / block table [{}, {}]", q_stride, n_q, n_seqs, bt_stride);
    MEMRA_CHECK(gate == nullptr || gate_stride >= n_heads, "paged_attention: gate_stride {} < n_heads {}",
                gate_stride, n_heads);
    MEMRA_CHECK(layer.k_row_bytes % n_kv_heads == 0 && layer.v_row_bytes % n_kv_heads == 0,
                "paged_attention: rows of {} / {} bytes for {} kv heads", layer.k_row_bytes, layer.v_row_bytes,
                n_kv_heads);
    auto visible_lo = [&](int64_t pos) {
        return shape.window > 0 ? std::max(first_pos, pos - shape.window + 1) : first_pos;
    };
    // Every visible position of every query must have a page.
    for (int64_t i = 0; i < n_q; ++i) {
        MEMRA_CHECK(q_seq[i] >= 0 && q_seq[i] < n_seqs && q_pos[i] >= first_pos && (q_pos[i] / kKvPageRows) <
                                                                                          bt_stride,
                    "paged_attention: query {} at position {} of sequence {} (first position {}, {} sequences, {} "
                    "blocks)",
                    i, q_pos[i], q_seq[i], first_pos, n_seqs, bt_stride);
        const int32_t *bt = block_tables + q_seq[i] * bt_stride;
        for (int64_t b = visible_lo(q_pos[i]) / kKvPageRows; b <= q_pos[i] / kKvPageRows; ++b) {
            MEMRA_CHECK(bt[b] >= 0, "paged_attention: query {} at position {} sees block {} of sequence {}, which "
                                    "has no page",
                        i, q_pos[i], b, q_seq[i]);
            MEMRA_CHECK(bt[b] < layer.n_pages, "paged_attention: block {} of sequence {} names page {} of a pool of {}",
                        b, q_seq[i], bt[b], layer.n_pages);
        }
    }
    const int64_t group = n_heads / n_kv_heads;
    const int64_t k_head_bytes = layer.k_row_bytes / n_kv_heads;
    const int64_t v_head_bytes = layer.v_row_bytes / n_kv_heads;
    const float scale = shape.scale;

    const int64_t batches = (group + kHeadBatch - 1) / kHeadBatch;  // head batches per kv head
    // One work item of either order: query i, kv head g, query heads [h0, h0 + nh), visible positions [lo, hi].
    struct WorkItem {
        int64_t i, g, h0, nh, hi, lo;
        const int32_t *bt;
        const PagedLayer *layer;
        std::byte *page(int64_t p) const {
            return layer->base + static_cast<int64_t>(bt[p / kKvPageRows]) * layer->page_bytes;
        }
    };
    auto work_item = [&](int64_t item) {
        WorkItem w{};
        w.i = item / (n_kv_heads * batches);
        w.g = (item / batches) % n_kv_heads;
        w.h0 = w.g * group + (item % batches) * kHeadBatch;
        w.nh = std::min(kHeadBatch, (w.g + 1) * group - w.h0);
        w.hi = q_pos[w.i];
        w.lo = visible_lo(w.hi);
        w.bt = block_tables + q_seq[w.i] * bt_stride;
        w.layer = &layer;
        return w;
    };
    const int64_t n_items = n_q * n_kv_heads * batches;
    if (shape.blocked) {
        const bool round_keys = layer.k_format == KvFormat::kF32 || layer.k_format == KvFormat::kBf16;
        const int64_t padded_dim = (head_dim + kReduceLanes - 1) / kReduceLanes * kReduceLanes;
        // The loops of the blocked order, over the inner operations of one instruction path (Ops). Each query
        // runs its own sequence of operations; a run of up to kQueryRun queries of one sequence whose visible
        // ranges overlap (a prefill's neighbouring rows) shares the decoded keys and values: every chunk of
        // positions is decoded once for the run and each query takes the part in its range. Scores are kept at
        // their offset in the aligned split, so a query's operations see the values and offsets they would see
        // alone (the score of a key and the value chain over positions do not depend on the chunking).
        //
        // Work items: (block of kQueryRun queries, kv head, head batch, member). A block whose queries form such
        // a run is served whole by its member 0 (the others return at once); otherwise member u serves query u
        // of the block alone, so batches of single-row sequences keep one item per query.
        const int64_t n_blocks = (n_q + kQueryRun - 1) / kQueryRun;
        const int64_t n_blocked_items = n_blocks * n_kv_heads * batches * kQueryRun;
        auto blocked = [&](auto ops) {
            using Ops = decltype(ops);
            pool.parallel_for_dynamic(n_blocked_items, [&](int64_t begin, int64_t end) {
                // q rows and decoded keys or values, zero past head_dim up to padded_dim (Ops::decode and the copy
                // below write only head_dim values, so the zeros stay). A query's part of a chunk starts at any of
                // its rows, and Ops::score reads kKeyChunk rows from there: rows holds twice the chunk.
                alignas(64) float qbuf[kQueryRun][kHeadBatch][kMaxHeadDim];
                alignas(64) float rows[2 * kKeyChunk][kMaxHeadDim] = {};
                alignas(64) float scores[kQueryRun][kHeadBatch][kSplitRows];  // s_p of the split, then e_p
                alignas(64) float acc[kQueryRun][kHeadBatch][kMaxHeadDim];    // the split's acc (ACC lives in out)
                float m[kQueryRun][kHeadBatch];
                float l[kQueryRun][kHeadBatch];
                float m_new[kQueryRun][kHeadBatch];
                float b_sum[kQueryRun][kHeadBatch];
                bool live[kQueryRun][kHeadBatch];
                bool any_live[kQueryRun];
                bool started[kQueryRun];
                float run_m[kQueryRun][kHeadBatch];
                float run_l[kQueryRun][kHeadBatch];
                int64_t q_lo[kQueryRun];
                int64_t q_hi[kQueryRun];
                for (auto &qu : qbuf) {
                    for (auto &qj : qu) std::fill(qj + head_dim, qj + padded_dim, 0.0f);
                }
                for (int64_t item = begin; item < end; ++item) {
                    const int64_t member = item % kQueryRun;
                    const int64_t rest = item / kQueryRun;
                    const int64_t g = (rest / batches) % n_kv_heads;
                    const int64_t h0 = g * group + (rest % batches) * kHeadBatch;
                    const int64_t nh = std::min(kHeadBatch, (g + 1) * group - h0);
                    const int64_t block0 = rest / (batches * n_kv_heads) * kQueryRun;
                    const int64_t block1 = std::min(n_q, block0 + kQueryRun);
                    // The run: the whole block when it is one sequence with overlapping ranges, else one query.
                    bool whole = true;
                    int64_t max_lo = 0;
                    int64_t min_hi = std::numeric_limits<int64_t>::max();
                    for (int64_t i = block0; i < block1; ++i) {
                        whole = whole && q_seq[i] == q_seq[block0];
                        max_lo = std::max(max_lo, visible_lo(q_pos[i]));
                        min_hi = std::min(min_hi, q_pos[i]);
                    }
                    whole = whole && max_lo <= min_hi + 1;
                    if (whole ? member != 0 : block0 + member >= block1) continue;
                    const int64_t r0 = whole ? block0 : block0 + member;
                    const int64_t nq = whole ? block1 - block0 : 1;
                    const int32_t *bt = block_tables + q_seq[r0] * bt_stride;
                    const auto page = [&](int64_t p) {
                        return layer.base + static_cast<int64_t>(bt[p / kKvPageRows]) * layer.page_bytes;
                    };
                    // Positions [p0, p0 + n) of kv head g's keys or values, decoded into rows[0 .. n).
                    auto decode_rows = [&](KvFormat format, int64_t offset, int64_t row_bytes, int64_t head_bytes,
                                           int64_t p0, int64_t n, bool round) {
                        for (int64_t c = 0; c < n; ++c) {
                            const int64_t p = p0 + c;
                            Ops::decode(format, page(p) + offset + (p % kKvPageRows) * row_bytes + g * head_bytes,
                                        head_dim, round, rows[c]);
                        }
                    };
                    int64_t lo = std::numeric_limits<int64_t>::max();
                    int64_t hi = 0;
                    for (int64_t u = 0; u < nq; ++u) {
                        q_hi[u] = q_pos[r0 + u];
                        q_lo[u] = visible_lo(q_hi[u]);
                        lo = std::min(lo, q_lo[u]);
                        hi = std::max(hi, q_hi[u]);
                        started[u] = false;
                        for (int64_t j = 0; j < nh; ++j) {
                            const float *qv = q + (r0 + u) * q_stride + (h0 + j) * head_dim;
                            std::copy(qv, qv + head_dim, qbuf[u][j]);
                        }
                    }
                    // Query u's part of [a, b]: [max(a, lo_u), min(b, hi_u)], empty when first > last.
                    const auto part = [&](int64_t u, int64_t a, int64_t b_) {
                        return std::pair{std::max(a, q_lo[u]), std::min(b_, q_hi[u])};
                    };
                    for (int64_t s0 = lo; s0 <= hi;) {
                        const int64_t base = s0 / kSplitRows * kSplitRows;   // the aligned split's first position
                        const int64_t s1 = std::min(hi, base + kSplitRows - 1);  // the run's part of the split
                        // The split's scores, each key decoded once.
                        for (int64_t p0 = s0; p0 <= s1; p0 += kKeyChunk) {
                            const int64_t n = std::min(kKeyChunk, s1 - p0 + 1);  // keys [p0, p0 + n)
                            decode_rows(layer.k_format, layer.k_offset, layer.k_row_bytes, k_head_bytes, p0, n,
                                        round_keys);
                            for (int64_t u = 0; u < nq; ++u) {
                                const auto [c0, c1] = part(u, p0, p0 + n - 1);
                                if (c0 > c1) continue;
                                Ops::score(qbuf[u], nh, rows + (c0 - p0), c1 - c0 + 1, head_dim, scale, scores[u],
                                           c0 - base);
                            }
                        }
                        for (int64_t u = 0; u < nq; ++u) {
                            for (int64_t j = 0; j < nh; ++j) {
                                m[u][j] = kNegInf;
                                l[u][j] = 0.0f;
                                for (int64_t d = 0; d < head_dim; ++d) acc[u][j][d] = 0.0f;
                            }
                        }
                        for (int64_t b0 = s0; b0 <= s1;) {
                            const int64_t b1 = std::min(s1, (b0 / kBlockRows + 1) * kBlockRows - 1);  // block [b0, b1]
                            for (int64_t u = 0; u < nq; ++u) {
                                const auto [e0, e1] = part(u, b0, b1);
                                any_live[u] = false;
                                if (e0 > e1) continue;
                                for (int64_t j = 0; j < nh; ++j) {
                                    const float bm = Ops::block_max(scores[u][j] + (e0 - base), e1 - e0 + 1);
                                    m_new[u][j] = bm > m[u][j] ? bm : m[u][j];
                                    live[u][j] = m_new[u][j] != kNegInf;
                                    any_live[u] = any_live[u] || live[u][j];
                                }
                                Ops::exp_sums(scores[u], e0 - base, e1 - e0 + 1, nh, live[u], m_new[u], b_sum[u]);
                                for (int64_t j = 0; j < nh; ++j) {
                                    if (!live[u][j]) continue;
                                    const float alpha = m[u][j] == kNegInf ? 0.0f : exp_f32(m[u][j] - m_new[u][j]);
                                    l[u][j] = l[u][j] * alpha + b_sum[u][j];
                                    for (int64_t d = 0; d < head_dim; ++d) acc[u][j][d] = acc[u][j][d] * alpha;
                                    m[u][j] = m_new[u][j];
                                }
                            }
                            bool values = false;
                            for (int64_t u = 0; u < nq; ++u) values = values || any_live[u];
                            for (int64_t p0 = b0; values && p0 <= b1; p0 += kKeyChunk) {
                                const int64_t n = std::min(kKeyChunk, b1 - p0 + 1);  // values [p0, p0 + n)
                                decode_rows(layer.v_format, layer.v_offset, layer.v_row_bytes, v_head_bytes, p0, n,
                                            true);
                                for (int64_t u = 0; u < nq; ++u) {
                                    const auto [c0, c1] = part(u, p0, p0 + n - 1);
                                    if (!any_live[u] || c0 > c1) continue;
                                    Ops::add_values(acc[u], scores[u], c0 - base, c1 - c0 + 1, nh, live[u],
                                                    rows + (c0 - p0), head_dim);
                                }
                            }
                            b0 = b1 + 1;
                        }
                        // Merge each query's part of the split into its running state, left to right.
                        for (int64_t u = 0; u < nq; ++u) {
                            const auto [e0, e1] = part(u, s0, s1);
                            if (e0 > e1) continue;
                            float *o = out + ((r0 + u) * n_heads + h0) * head_dim;
                            for (int64_t j = 0; j < nh; ++j) {
                                float *oj = o + j * head_dim;
                                if (!started[u]) {
                                    run_m[u][j] = m[u][j];
                                    run_l[u][j] = l[u][j];
                                    for (int64_t d = 0; d < head_dim; ++d) oj[d] = acc[u][j][d];
                                    continue;
                                }
                                const float m_next = m[u][j] > run_m[u][j] ? m[u][j] : run_m[u][j];
                                const float a = exp_f32(run_m[u][j] - m_next);
                                const float b = exp_f32(m[u][j] - m_next);
                                run_l[u][j] = run_l[u][j] * a + l[u][j] * b;
                                for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] * a + acc[u][j][d] * b;
                                run_m[u][j] = m_next;
                            }
                            started[u] = true;
                        }
                        s0 = s1 + 1;
                    }
                    for (int64_t u = 0; u < nq; ++u) {
                        const int64_t i = r0 + u;
                        float *o = out + (i * n_heads + h0) * head_dim;
                        for (int64_t j = 0; j < nh; ++j) {
                            float *oj = o + j * head_dim;
                            for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] / run_l[u][j];
                            if (gate != nullptr) {
                                const float gv = sigmoid_f32(gate[i * gate_stride + h0 + j]);
                                for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] * gv;
                            }
                        }
                    }
                }
            }, kItemGrain);
        };
#if MEMRA_X86
        if (product_isa() == ProductIsa::kAvx512Bf16) {
            blocked(BlockedAvx512{});
            return;
        }
        if (product_isa() != ProductIsa::kPortable) {
            blocked(BlockedAvx2{});
            return;
        }
#endif
        blocked(BlockedPortable{});
        return;
    }
    pool.parallel_for_dynamic(n_items, [&](int64_t begin, int64_t end) {
        float kbuf[kMaxHeadDim];
        float vbuf[kMaxHeadDim];
        float scores[kHeadBatch][kScoreCache];
        float m[kHeadBatch];
        float l[kHeadBatch];
        for (int64_t item = begin; item < end; ++item) {
            const WorkItem w = work_item(item);
            const int64_t i = w.i, g = w.g, h0 = w.h0, nh = w.nh, hi = w.hi, lo = w.lo;
            auto row = [&](int64_t p) { return w.page(p); };
            auto decode_key = [&](int64_t p) {
                kv_decode(layer.k_format,
                          row(p) + layer.k_offset + (p % kKvPageRows) * layer.k_row_bytes + g * k_head_bytes,
                          head_dim, kbuf);
            };
            const float *qv[kHeadBatch];
            for (int64_t j = 0; j < nh; ++j) {
                qv[j] = q + i * q_stride + (h0 + j) * head_dim;
                m[j] = -std::numeric_limits<float>::infinity();
                l[j] = 0.0f;
            }
            // Pass 1: scores and their max, increasing p.
            for (int64_t p = lo; p <= hi; ++p) {
                decode_key(p);
                for (int64_t j = 0; j < nh; ++j) {
                    const float s = dot_f32(qv[j], kbuf, head_dim) * scale;
                    if (p - lo < kScoreCache) scores[j][p - lo] = s;
                    m[j] = s > m[j] ? s : m[j];
                }
            }
            // Pass 2: exp weights and the weighted values, increasing p.
            float *o = out + (i * n_heads + h0) * head_dim;  // heads h0 .. h0 + nh of query i, contiguous
            for (int64_t d = 0; d < nh * head_dim; ++d) o[d] = 0.0f;
            for (int64_t p = lo; p <= hi; ++p) {
                const bool cached = p - lo < kScoreCache;
                if (!cached) decode_key(p);
                kv_decode(layer.v_format,
                          row(p) + layer.v_offset + (p % kKvPageRows) * layer.v_row_bytes + g * v_head_bytes,
                          head_dim, vbuf);
                for (int64_t j = 0; j < nh; ++j) {
                    const float s = cached ? scores[j][p - lo] : dot_f32(qv[j], kbuf, head_dim) * scale;
                    const float e = exp_f32(s - m[j]);
                    l[j] = l[j] + e;
                    float *oj = o + j * head_dim;
                    for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] + e * vbuf[d];
                }
            }
            for (int64_t j = 0; j < nh; ++j) {
                float *oj = o + j * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] / l[j];
                if (gate != nullptr) {
                    const float gv = sigmoid_f32(gate[i * gate_stride + h0 + j]);
                    for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] * gv;
                }
            }
        }
    }, kItemGrain);
}

PagedLayer pool_layer(const KvPoolSpec &spec, const KvPageLayout &layout, std::byte *base, int layer) {
    MEMRA_CHECK(layer >= 0 && static_cast<size_t>(layer) < spec.layers.size(), "KV pool layer {} of {}", layer,
                spec.layers.size());
    const auto l = static_cast<size_t>(layer);
    PagedLayer p;
    p.base = base;
    p.n_pages = spec.n_pages;
    p.page_bytes = layout.page_bytes;
    p.k_offset = layout.k_offset[l];
    p.v_offset = layout.v_offset[l];
    p.k_row_bytes = layout.k_row_bytes[l];
    p.v_row_bytes = layout.v_row_bytes[l];
    p.k_format = spec.k_format;
    p.v_format = spec.v_format;
    return p;
}

}  // namespace memra::cpu
