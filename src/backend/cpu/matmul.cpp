// The canonical K loop (matmul.h) as register-tiled kernels: a tile of up to 4 weight rows times 4 tokens
// shares each converted 16-element weight group, so decode streams W once and prefill reuses every loaded
// row for several tokens. The 16 lanes are one GCC vector value that g++ maps onto SSE, AVX2 or AVX-512
// registers (one clone per ISA, picked at load time); lane-wise IEEE operations only, no sum reordered.
#include "backend/cpu/matmul.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "backend/cpu/matmul_kernels.h"
#include "core/check.h"
#include "core/float_formats.h"

namespace memra::cpu {
namespace {

using namespace detail;

// Register tile: rows of W x tokens of x computed together. 4 x 4 x 16 lanes fill 16 AVX-512 registers.
constexpr int kTileRows = 4;
constexpr int kTileTokens = 4;
// Rows of W kept hot (L2) while every token tile passes over them (prefill reuse).
constexpr int64_t kRowBlock = 16;

[[gnu::always_inline]] inline F32x16 load_f32x16(const float *p) {
    F32x16 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

[[gnu::always_inline]] inline U32x16 splat(uint32_t u) { return U32x16{} + u; }

// Exact widening of 16 stored elements, without branches so it stays in vector registers. Each lane
// equals core/float_formats.h's scalar conversion bit for bit (pinned by the tests over every pattern).
[[gnu::always_inline]] inline F32x16 widen_bf16(const uint16_t *p) {
    U16x16 h;
    std::memcpy(&h, p, sizeof(h));
    return vec_bits<F32x16>(__builtin_convertvector(h, U32x16) << 16);
}

[[gnu::always_inline]] inline F32x16 widen_f16(const uint16_t *p) {
    U16x16 h16;
    std::memcpy(&h16, p, sizeof(h16));
    const U32x16 h = __builtin_convertvector(h16, U32x16);
    const U32x16 sign = (h & 0x8000u) << 16;
    const U32x16 mag = h & 0x7fffu;
    // Normal: re-bias the exponent (15 -> 127) by adding 112 to the shifted field.
    const U32x16 normal = (mag << 13) + (112u << 23);
    // Exponent 31: Inf or NaN with its payload.
    const U32x16 special = (mag << 13) | 0x7f800000u;
    // Exponent 0: mantissa * 2^-24, exact through an integer conversion (no denormal arithmetic).
    const F32x16 sub = __builtin_convertvector(vec_bits<I32x16>(mag), F32x16) * 0x1p-24f;
    U32x16 bits = mag >= 0x7c00u ? special : normal;
    bits = mag < 0x400u ? vec_bits<U32x16>(sub) : bits;
    return vec_bits<F32x16>(bits | sign);
}

[[gnu::always_inline]] inline F32x16 widen_fp8_e4m3(const uint8_t *p) {
    U8x16 c8;
    std::memcpy(&c8, p, sizeof(c8));
    // Widened in two steps: GCC 12 turns a direct u8 -> u32 vector conversion into scalar code.
    const U32x16 c = __builtin_convertvector(__builtin_convertvector(c8, U16x16), U32x16);
    const U32x16 sign = (c & 0x80u) << 24;
    const U32x16 mag = c & 0x7fu;
    const U32x16 normal = (mag << 20) + (120u << 23);  // exponent bias 7 -> 127
    const F32x16 sub = __builtin_convertvector(vec_bits<I32x16>(mag), F32x16) * 0x1p-9f;
    U32x16 bits = mag < 8u ? vec_bits<U32x16>(sub) : normal;
    bits = mag == 0x7fu ? splat(0x7fc00000u) : bits;  // S.1111.111 is NaN (e4m3fn has no infinities)
    return vec_bits<F32x16>(bits | sign);
}

// Elements [k, k + 16) of a weight row.
template <DType kDt>
[[gnu::always_inline]] inline F32x16 widen16(const void *row, int64_t k) {
    if constexpr (kDt == DType::kF32) {
        return load_f32x16(static_cast<const float *>(row) + k);
    } else if constexpr (kDt == DType::kBF16) {
        return widen_bf16(static_cast<const uint16_t *>(row) + k);
    } else if constexpr (kDt == DType::kF16) {
        return widen_f16(static_cast<const uint16_t *>(row) + k);
    } else {
        return widen_fp8_e4m3(static_cast<const uint8_t *>(row) + k);
    }
}

// Element k of a weight row (chunk tails), the same values as widen16.
template <DType kDt>
[[gnu::always_inline]] inline float widen1(const void *row, int64_t k) {
    if constexpr (kDt == DType::kF32) {
        return static_cast<const float *>(row)[k];
    } else if constexpr (kDt == DType::kBF16) {
        return bf16_to_f32(static_cast<const uint16_t *>(row)[k]);
    } else if constexpr (kDt == DType::kF16) {
        return f16_to_f32(static_cast<const uint16_t *>(row)[k]);
    } else {
        return fp8_e4m3_to_f32(static_cast<const uint8_t *>(row)[k]);
    }
}

inline int64_t weight_elem_size(DType dt) { return static_cast<int64_t>(dtype_size(dt)); }

// The canonical K loop (matmul.h) for kR rows starting at `n` and kT tokens over [k0, k1).
// xs[t] points at x[t][k0]; y[t * y_stride + r] receives dot(x_t, W[n + r]).
template <DType kDt, int kR, int kT>
[[gnu::always_inline]] inline void dot_tile(const WeightRef &w, int64_t n, const float *const *xs, int64_t k0,
                                            int64_t k1, float *y, int64_t y_stride) {
    static_assert(kR * kT <= 16, "at most 16 accumulators");
    const int64_t edge = w.block_cols;
    constexpr int64_t elem = kDt == DType::kF32 ? 4 : (kDt == DType::kF8E4M3 ? 1 : 2);  // bytes per element
    // rows[r] holds the window's columns: absolute K position k is element k - kb of it.
    const int64_t kb = w.k_begin;
    const int64_t ld = weight_ld(w);
    const void *rows[kR];
    const float *scale_rows[kR];
    const int64_t scale_cols = (weight_k_full(w) + edge - 1) / edge;
    for (int r = 0; r < kR; ++r) {
        rows[r] = static_cast<const uint8_t *>(w.data) + (n + r) * ld * elem;
        if constexpr (kDt == DType::kF8E4M3) {
            scale_rows[r] = w.scale_inv + ((w.row_offset + n + r) / w.block_rows) * scale_cols;
        } else {
            scale_rows[r] = nullptr;
        }
    }
    float total[kR * kT];
    for (int i = 0; i < kR * kT; ++i) total[i] = 0.0f;

    // Chunk ci covers [max(k0, ci * edge), min(k1, (ci + 1) * edge)); one division per call, not per chunk.
    int64_t ci = k0 / edge;
    int64_t c0 = k0;
    while (c0 < k1) {
        const int64_t c1 = std::min(k1, (ci + 1) * edge);
        // acc[r * kT + t]: the 16 lanes of row r, token t; unused entries stay 0 for the tree.
        F32x16 acc[16] = {};
        int64_t k = c0;
        for (; k + kLanes <= c1; k += kLanes) {
            F32x16 wv[kR];
            for (int r = 0; r < kR; ++r) wv[r] = widen16<kDt>(rows[r], k - kb);
            for (int t = 0; t < kT; ++t) {
                const F32x16 xv = load_f32x16(xs[t] + (k - k0));
                for (int r = 0; r < kR; ++r) {
                    const F32x16 p = xv * wv[r];
                    acc[r * kT + t] = acc[r * kT + t] + p;
                }
            }
        }
        // Tail of a chunk shorter than a multiple of 16: lanes 0 .. c1-k-1 take one more element.
        for (int j = 0; k + j < c1; ++j) {
            for (int r = 0; r < kR; ++r) {
                const float wj = widen1<kDt>(rows[r], k + j - kb);
                for (int t = 0; t < kT; ++t) {
                    const float p = xs[t][k + j - k0] * wj;
                    acc[r * kT + t][j] = acc[r * kT + t][j] + p;
                }
            }
        }
        float s[16];
        lane_tree8(acc, s);
        if constexpr (kR * kT > 8) lane_tree8(acc + 8, s + 8);
        for (int r = 0; r < kR; ++r) {
            for (int t = 0; t < kT; ++t) {
                float chunk = s[r * kT + t];
                if constexpr (kDt == DType::kF8E4M3) chunk = chunk * scale_rows[r][ci];
                total[r * kT + t] = total[r * kT + t] + chunk;
            }
        }
        c0 = c1;
        ++ci;
    }
    for (int r = 0; r < kR; ++r) {
        for (int t = 0; t < kT; ++t) y[t * y_stride + r] = total[r * kT + t];
    }
}

// Runs one tile of rr rows (4 or 1) by tt tokens (4, 2 or 1): the one place a shape is picked at run time.
template <DType kDt>
[[gnu::always_inline]] inline void dot_tile_any(int rr, int tt, const WeightRef &w, int64_t n, const float *const *xs,
                                                int64_t k0, int64_t k1, float *y, int64_t y_stride) {
    static_assert(kTileRows == 4 && kTileTokens == 4, "the switch below lists every tile shape");
    switch (rr * 8 + tt) {
        case 4 * 8 + 4: dot_tile<kDt, 4, 4>(w, n, xs, k0, k1, y, y_stride); break;
        case 4 * 8 + 2: dot_tile<kDt, 4, 2>(w, n, xs, k0, k1, y, y_stride); break;
        case 4 * 8 + 1: dot_tile<kDt, 4, 1>(w, n, xs, k0, k1, y, y_stride); break;
        case 1 * 8 + 4: dot_tile<kDt, 1, 4>(w, n, xs, k0, k1, y, y_stride); break;
        case 1 * 8 + 2: dot_tile<kDt, 1, 2>(w, n, xs, k0, k1, y, y_stride); break;
        default: dot_tile<kDt, 1, 1>(w, n, xs, k0, k1, y, y_stride); break;
    }
}

// Rows [r_begin, r_end) x tokens [t_begin, t_end) of a task (both relative to the task). Tiles take 4
// tokens while 4 remain, then 2, then 1; 4 rows while 4 remain, then 1. The tiling never shows in the
// bits: each (row, token) pair runs the same K loop in any tile.
template <DType kDt>
[[gnu::always_inline]] inline void run_task_range(const Task &task, int64_t r_begin, int64_t r_end,
                                                  int64_t t_begin, int64_t t_end) {
    const WeightRef &w = *task.w;
    for (int64_t rb = r_begin; rb < r_end; rb += kRowBlock) {
        const int64_t re = std::min(r_end, rb + kRowBlock);
        int tt = 0;
        for (int64_t t = t_begin; t < t_end; t += tt) {
            tt = t_end - t >= 4 ? 4 : (t_end - t >= 2 ? 2 : 1);
            int rr = 0;
            for (int64_t r = rb; r < re; r += rr) {
                rr = re - r >= 4 ? 4 : 1;
                for (int64_t s = 0; s < task.n_segs; ++s) {
                    const float *xs[kTileTokens];
                    for (int i = 0; i < tt; ++i) xs[i] = task.x + (t + i) * task.x_stride + s * task.seg_len;
                    const int64_t k0 = task.seg_k0 + s * task.seg_len;
                    float *ys = task.y + s * task.seg_out_stride + t * task.y_stride + r;
                    dot_tile_any<kDt>(rr, tt, w, task.n0 + r, xs, k0, k0 + task.seg_len, ys, task.y_stride);
                }
            }
        }
    }
}

// One entry point per dtype, each cloned per ISA (AVX-512, AVX2, baseline) and picked once at load
// time. Every clone performs the same IEEE fp32 operations in the same order, so the bits are the
// same on any x86-64 host; only the vector width differs.
#define MEMRA_ISA_CLONES [[gnu::target_clones("avx512f", "avx2", "default")]]

MEMRA_ISA_CLONES void run_f32(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    run_task_range<DType::kF32>(task, rb, re, tb, te);
}
MEMRA_ISA_CLONES void run_bf16(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    run_task_range<DType::kBF16>(task, rb, re, tb, te);
}
MEMRA_ISA_CLONES void run_f16(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    run_task_range<DType::kF16>(task, rb, re, tb, te);
}
MEMRA_ISA_CLONES void run_fp8(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    run_task_range<DType::kF8E4M3>(task, rb, re, tb, te);
}

#undef MEMRA_ISA_CLONES

void run_range(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te) {
    if (task.xq != nullptr) {
        run_device_range(task, rb, re, tb, te);
        return;
    }
    switch (task.w->dtype) {
        case DType::kF32: run_f32(task, rb, re, tb, te); return;
        case DType::kBF16: run_bf16(task, rb, re, tb, te); return;
        case DType::kF16: run_f16(task, rb, re, tb, te); return;
        case DType::kF8E4M3: run_fp8(task, rb, re, tb, te); return;
        default: MEMRA_CHECK(false, "matmul: unsupported weight dtype {}", dtype_name(task.w->dtype));
    }
}

void check_weight(const WeightRef &w) {
    const DType dt = w.dtype;
    MEMRA_CHECK(dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16 || dt == DType::kF8E4M3,
                "matmul: weight dtype must be F32, BF16, F16 or F8_E4M3, got {}", dtype_name(dt));
    MEMRA_CHECK(w.rows >= 0 && w.cols >= 0, "matmul: weight shape [{}, {}] is negative", w.rows, w.cols);
    MEMRA_CHECK(w.data != nullptr || w.rows * w.cols == 0, "matmul: weight [{}, {}] has no data", w.rows, w.cols);
    MEMRA_CHECK(w.block_rows >= 1 && w.block_cols >= 1, "matmul: block edges must be >= 1, got [{}, {}]",
                w.block_rows, w.block_cols);
    MEMRA_CHECK(w.row_offset >= 0, "matmul: weight row_offset {} is negative", w.row_offset);
    MEMRA_CHECK(weight_ld(w) >= w.cols && w.k_begin >= 0 && w.k_begin + w.cols <= weight_k_full(w),
                "matmul: weight window of {} columns at K {} (row stride {}) does not fit a matrix of K = {}", w.cols,
                w.k_begin, weight_ld(w), weight_k_full(w));
    if (dt == DType::kF8E4M3) {
        MEMRA_CHECK(w.scale_inv != nullptr || w.rows * w.cols == 0, "matmul: F8_E4M3 weight [{}, {}] has no scale_inv",
                    w.rows, w.cols);
    }
    MEMRA_CHECK(w.act != ActRounding::kBf16 || dt == DType::kBF16, "matmul: bf16 activations need BF16 weights, got {}",
                dtype_name(dt));
    MEMRA_CHECK(w.act != ActRounding::kE4m3x128 ||
                    (dt == DType::kF8E4M3 && w.block_cols == kE4m3Group && weight_has_full_k(w)),
                "matmul: e4m3 activation groups need F8_E4M3 weights with {}-wide scale blocks and every K column, got "
                "{} with blocks of {} holding K [{}, {}) of {}",
                kE4m3Group, dtype_name(dt), w.block_cols, w.k_begin, w.k_begin + w.cols, weight_k_full(w));
}

// Rounds the task's activations (x: [n_tokens, x_stride]) into scratch when w is a device product.
void prepare_device_inputs(ThreadPool &pool, Task &task, const ActScratch *scratch) {
    const ActRounding act = task.w->act;
    if (act == ActRounding::kNone) return;
    MEMRA_CHECK(scratch != nullptr, "matmul: a device product ({} activations) needs an activation scratch",
                act == ActRounding::kBf16 ? "bf16" : "e4m3");
    round_activations(pool, task.x, task.n_tokens, task.x_stride, act, *scratch);
    task.xq = scratch->codes;
    task.xs = scratch->scales;
    task.xs_stride = (task.x_stride + kE4m3Group - 1) / kE4m3Group;
}

// Runs a task over the pool. Threads take contiguous row ranges when there are enough rows (each thread
// then streams its own part of W once), otherwise contiguous token ranges; either way one thread computes
// each output element, in the same order, so the split never shows in the bits.
void run_task(ThreadPool &pool, const Task &task) {
    if (task.n_rows == 0 || task.n_tokens == 0) return;
    const int64_t threads = pool.n_threads();
    const bool split_rows = task.n_rows >= 32 * threads || task.n_tokens < 4 * threads;
    if (split_rows) {
        pool.parallel_for(
            task.n_rows, [&task](int64_t b, int64_t e) { run_range(task, b, e, 0, task.n_tokens); }, kRowBlock);
    } else {
        pool.parallel_for(
            task.n_tokens, [&task](int64_t b, int64_t e) { run_range(task, 0, task.n_rows, b, e); }, kTileTokens);
    }
}

// The fixed balanced tree over m = 1, 2, 4 or 8 values per element: v: [m, n]; out: [n].
// One loop per m, so that the compiler runs each in vector lanes (the same adds per element).
void balanced_tree(const float *v, int64_t m, int64_t n, float *out) {
    const float *p[8];
    for (int64_t j = 0; j < m; ++j) p[j] = v + j * n;
    switch (m) {
        case 1: std::copy(p[0], p[0] + n, out); return;
        case 2:
            for (int64_t i = 0; i < n; ++i) out[i] = p[0][i] + p[1][i];
            return;
        case 4:
            for (int64_t i = 0; i < n; ++i) out[i] = (p[0][i] + p[1][i]) + (p[2][i] + p[3][i]);
            return;
        default:
            for (int64_t i = 0; i < n; ++i) {
                out[i] = ((p[0][i] + p[1][i]) + (p[2][i] + p[3][i])) + ((p[4][i] + p[5][i]) + (p[6][i] + p[7][i]));
            }
            return;
    }
}

}  // namespace

namespace {

int64_t bank_expert_elems(const WeightBankRef &bank) { return bank.rows * bank.cols; }
int64_t bank_scale_floats(const WeightBankRef &bank) {
    return ((bank.rows + bank.block_rows - 1) / bank.block_rows) * ((bank.cols + bank.block_cols - 1) / bank.block_cols);
}

}  // namespace

WeightRef weight_bank_expert(const WeightBankRef &bank, int64_t expert) {
    MEMRA_CHECK(expert >= 0 && expert < bank.n_experts, "weight bank: expert {} out of range [0, {})", expert,
                bank.n_experts);
    MEMRA_CHECK(bank.block_rows >= 1 && bank.block_cols >= 1, "weight bank: block edges must be >= 1, got [{}, {}]",
                bank.block_rows, bank.block_cols);
    WeightRef w;
    w.dtype = bank.dtype;
    w.rows = bank.rows;
    w.cols = bank.cols;
    w.block_rows = bank.block_rows;
    w.block_cols = bank.block_cols;
    w.act = bank.act;
    w.data = static_cast<const uint8_t *>(bank.data) + expert * bank_expert_elems(bank) * weight_elem_size(bank.dtype);
    if (bank.scale_inv != nullptr) w.scale_inv = bank.scale_inv + expert * bank_scale_floats(bank);
    if (bank.panels != nullptr) {
        w.panels = device_panels_at(w, static_cast<const uint8_t *>(bank.panels) + expert * device_panels_bytes(w));
    }
    return w;
}

WeightBankRef weight_bank_window(const WeightBankRef &bank, int64_t e0, int64_t e1) {
    MEMRA_CHECK(0 <= e0 && e0 < e1 && e1 <= bank.n_experts, "weight bank window: experts [{}, {}) outside [0, {})",
                e0, e1, bank.n_experts);
    WeightBankRef s = bank;
    s.data = static_cast<const uint8_t *>(bank.data) + e0 * bank_expert_elems(bank) * weight_elem_size(bank.dtype);
    if (bank.scale_inv != nullptr) s.scale_inv = bank.scale_inv + e0 * bank_scale_floats(bank);
    if (bank.panels != nullptr) {
        s.panels = static_cast<const uint8_t *>(bank.panels) + e0 * device_panels_bytes(weight_bank_expert(bank, 0));
    }
    s.n_experts = e1 - e0;
    s.first_expert = bank.first_expert + e0;
    return s;
}

WeightRef weight_row_slice(const WeightRef &w, int64_t r0, int64_t r1) {
    MEMRA_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.rows, "weight row slice [{}, {}) outside rows [0, {})", r0, r1,
                w.rows);
    WeightRef s = w;
    s.data = static_cast<const uint8_t *>(w.data) + r0 * weight_ld(w) * weight_elem_size(w.dtype);
    s.rows = r1 - r0;
    s.row_offset = w.row_offset + r0;
    // The panels from r0 on, when r0 starts one (a panel is 16 rows of the view it was made from).
    const int64_t panel_rows = std::min(w.panels.rows - r0, s.rows) / 16 * 16;
    if (w.panels.data != nullptr && r0 % 16 == 0 && panel_rows > 0) {
        s.panels.data = static_cast<const uint8_t *>(w.panels.data) +
                        (r0 / 16) * w.panels.pairs * 32 * weight_elem_size(w.dtype);
        s.panels.rows = panel_rows;
    } else {
        s.panels = WeightPanels{};
    }
    return s;
}

WeightRef weight_k_window(const WeightRef &w, int64_t k0, int64_t k1) {
    MEMRA_CHECK(w.k_begin <= k0 && k0 < k1 && k1 <= w.k_begin + w.cols,
                "weight K window [{}, {}) outside the held K [{}, {})", k0, k1, w.k_begin, w.k_begin + w.cols);
    WeightRef s = w;
    s.ld = weight_ld(w);
    s.k_full = weight_k_full(w);
    s.data = static_cast<const uint8_t *>(w.data) + (k0 - w.k_begin) * weight_elem_size(w.dtype);
    s.cols = k1 - k0;
    s.k_begin = k0;
    return s;
}

void matmul(ThreadPool &pool, const float *x, int64_t n_tokens, const WeightRef &w, float *y,
            const ActScratch *scratch) {
    matmul_rows(pool, x, n_tokens, w, 0, w.rows, y, w.rows, scratch);
}

void matmul_rows(ThreadPool &pool, const float *x, int64_t n_tokens, const WeightRef &w, int64_t n0, int64_t n1,
                 float *y, int64_t y_stride, const ActScratch *scratch) {
    check_weight(w);
    MEMRA_CHECK(weight_has_full_k(w), "matmul: a column-parallel product needs every K column, the weight holds "
                "K [{}, {}) of {}", w.k_begin, w.k_begin + w.cols, weight_k_full(w));
    MEMRA_CHECK(n_tokens >= 0, "matmul: n_tokens {} is negative", n_tokens);
    MEMRA_CHECK(0 <= n0 && n0 <= n1 && n1 <= w.rows, "matmul: output rows [{}, {}) outside weight rows [0, {})", n0,
                n1, w.rows);
    MEMRA_CHECK(y_stride >= n1 - n0, "matmul: y_stride {} is less than the {} outputs per token", y_stride, n1 - n0);
    Task task;
    task.w = &w;
    task.x = x;
    task.x_stride = w.cols;
    task.n_tokens = n_tokens;
    task.n0 = n0;
    task.n_rows = n1 - n0;
    task.seg_k0 = 0;
    task.seg_len = w.cols;
    task.n_segs = 1;
    task.y = y;
    task.y_stride = y_stride;
    prepare_device_inputs(pool, task, scratch);
    run_task(pool, task);
}

void matmul_grouped(ThreadPool &pool, const float *x, const WeightBankRef &bank, const int32_t *rows, float *y,
                    const ActScratch *scratch) {
    MEMRA_CHECK(bank.n_experts >= 1, "matmul_grouped: a bank of {} experts", bank.n_experts);
    const WeightRef w0 = weight_bank_expert(bank, 0);
    check_weight(w0);
    int64_t total_cost = 0;  // output elements: each expert's tokens times the bank's rows
    for (int64_t e = 0; e < bank.n_experts; ++e) {
        MEMRA_CHECK(rows[e] <= rows[e + 1], "matmul_grouped: expert {} has rows [{}, {})", e, rows[e], rows[e + 1]);
        total_cost += int64_t{rows[e + 1] - rows[e]} * bank.rows;
    }
    const int64_t n_tokens = rows[bank.n_experts] - rows[0];
    if (n_tokens == 0 || bank.rows == 0) return;
    Task all;  // the rounded activations of every row, shared by the experts' tasks
    all.w = &w0;
    all.x = x;
    all.x_stride = bank.cols;
    all.n_tokens = n_tokens;
    prepare_device_inputs(pool, all, scratch);
    // Work items: the weight-row blocks of each expert with rows, in expert order; a prefill-sized expert takes
    // larger blocks (its activations are prepared once per item). The pool's threads take contiguous runs of items
    // of about equal cost; one thread computes each output element, so the split never shows in the bits.
    const auto block_rows = [](int64_t tokens) { return tokens >= 4 * kTileTokens ? 4 * kRowBlock : kRowBlock; };
    const int64_t n_slots = pool.n_threads();
    pool.parallel_for(n_slots, [&](int64_t slot_begin, int64_t slot_end) {
        const int64_t lo = total_cost * slot_begin / n_slots;
        const int64_t hi = total_cost * slot_end / n_slots;
        int64_t cost = 0;
        for (int64_t e = 0; e < bank.n_experts && cost < hi; ++e) {
            const int64_t r0 = rows[e] - rows[0];
            const int64_t tokens = rows[e + 1] - rows[e];
            const int64_t expert_cost = tokens * bank.rows;
            if (tokens == 0 || cost + expert_cost <= lo) {
                cost += expert_cost;
                continue;
            }
            const WeightRef w = weight_bank_expert(bank, e);
            Task task = all;
            task.w = &w;
            task.x = x + r0 * bank.cols;
            task.n_tokens = tokens;
            task.n_rows = bank.rows;
            task.seg_len = bank.cols;
            task.y = y + r0 * bank.rows;
            task.y_stride = bank.rows;
            if (all.xq != nullptr) {
                task.xq = all.xq + r0 * bank.cols;
                if (all.w->act == ActRounding::kE4m3x128) task.xs = all.xs + r0 * all.xs_stride;
            }
            const int64_t block = block_rows(tokens);
            for (int64_t rb = 0; rb < bank.rows; rb += block) {
                const int64_t start = cost + rb * tokens;  // an item belongs to the slot its first element falls in
                if (start >= lo && start < hi) run_range(task, rb, std::min(bank.rows, rb + block), 0, tokens);
            }
            cost += expert_cost;
        }
    }, 1);
}

int64_t canonical_block_size(const WeightRef &w) {
    const int64_t k = weight_k_full(w);
    MEMRA_CHECK(k > 0 && k % kCanonicalBlocks == 0,
                "row-parallel matmul: K = {} must be a positive multiple of the {} canonical blocks", k,
                kCanonicalBlocks);
    return k / kCanonicalBlocks;
}

BlockRange weight_canonical_blocks(const WeightRef &w) {
    const int64_t bs = canonical_block_size(w);
    MEMRA_CHECK(w.k_begin % bs == 0 && w.cols % bs == 0 && w.cols > 0,
                "row-parallel matmul: the weight holds K [{}, {}), not whole canonical blocks of {}", w.k_begin,
                w.k_begin + w.cols, bs);
    const BlockRange r{w.k_begin / bs, (w.k_begin + w.cols) / bs};
    const int64_t m = r.end - r.begin;
    MEMRA_CHECK((m == 1 || m == 2 || m == 4 || m == 8) && r.begin % m == 0,
                "row-parallel matmul: the weight holds blocks [{}, {}), not an aligned subtree", r.begin, r.end);
    return r;
}

void matmul_block_partials(ThreadPool &pool, const float *x_blocks, int64_t n_tokens, const WeightRef &w,
                           int64_t block_begin, int64_t block_end, float *partials, const ActScratch *scratch) {
    check_weight(w);
    MEMRA_CHECK(w.act != ActRounding::kE4m3x128, "row-parallel matmul: e4m3 activation groups span K blocks; only "
                "whole-K products quantize them");
    const int64_t bs = canonical_block_size(w);
    MEMRA_CHECK(0 <= block_begin && block_begin < block_end && block_end <= kCanonicalBlocks,
                "row-parallel matmul: block range [{}, {}) outside [0, {})", block_begin, block_end,
                kCanonicalBlocks);
    MEMRA_CHECK(block_begin * bs >= w.k_begin && block_end * bs <= w.k_begin + w.cols,
                "row-parallel matmul: blocks [{}, {}) are outside the held K [{}, {})", block_begin, block_end,
                w.k_begin, w.k_begin + w.cols);
    MEMRA_CHECK(n_tokens >= 0, "matmul: n_tokens {} is negative", n_tokens);
    Task task;
    task.w = &w;
    task.x = x_blocks;
    task.x_stride = (block_end - block_begin) * bs;
    task.n_tokens = n_tokens;
    task.n0 = 0;
    task.n_rows = w.rows;
    task.seg_k0 = block_begin * bs;
    task.seg_len = bs;
    task.n_segs = block_end - block_begin;
    task.y = partials;
    task.y_stride = w.rows;
    task.seg_out_stride = n_tokens * w.rows;
    prepare_device_inputs(pool, task, scratch);
    run_task(pool, task);
}

void canonical_tree_reduce(const float *partials, int64_t block_begin, int64_t block_end, int64_t n, float *out) {
    const int64_t m = block_end - block_begin;
    MEMRA_CHECK((m == 1 || m == 2 || m == 4 || m == 8) && block_begin >= 0 && block_end <= kCanonicalBlocks &&
                    block_begin % m == 0,
                "canonical tree: blocks [{}, {}) are not an aligned subtree (size 1, 2, 4 or 8, aligned to it)",
                block_begin, block_end);
    balanced_tree(partials, m, n, out);
}

void canonical_tree_combine(const float *subtree_sums, int64_t n_subtrees, int64_t n, float *out) {
    MEMRA_CHECK(n_subtrees == 1 || n_subtrees == 2 || n_subtrees == 4 || n_subtrees == 8,
                "canonical tree: {} subtree sums, expected 1, 2, 4 or 8", n_subtrees);
    balanced_tree(subtree_sums, n_subtrees, n, out);
}

int64_t matmul_canonical_workspace_floats(int64_t n_tokens, const WeightRef &w) {
    const BlockRange b = weight_canonical_blocks(w);
    return (b.end - b.begin) * n_tokens * w.rows;
}

void matmul_canonical(ThreadPool &pool, const float *x, int64_t n_tokens, const WeightRef &w, float *y,
                      float *workspace, const ActScratch *scratch) {
    const BlockRange b = weight_canonical_blocks(w);
    matmul_block_partials(pool, x, n_tokens, w, b.begin, b.end, workspace, scratch);
    canonical_tree_reduce(workspace, b.begin, b.end, n_tokens * w.rows, y);
}

}  // namespace memra::cpu
