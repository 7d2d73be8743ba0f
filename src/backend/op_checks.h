// The shape contracts of the Backend ops (backend.h), checked the same way by every backend before it launches:
// a violation is a programming error and aborts (MEMRA_CHECK) with the shapes involved. Only what a backend can
// see without reading its buffers is checked here; the CPU backend also checks indices it reads on the host, the
// CUDA kernels raise their error flag instead.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/check.h"
#include "core/sampling.h"

namespace memra::op_checks {

// ---- Uploads (prepare time): refusals as Results, `who` naming the backend ("cpu upload"). ----

// The weight dtypes products read.
inline bool linear_dtype(DType t) {
    return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kF8E4M3;
}

// A range [begin, end) of an axis of n entries: non-empty and inside.
inline Result<void> window_axis(const char *who, const char *what, int64_t begin, int64_t end, int64_t n) {
    if (begin < 0 || begin >= end || end > n) {
        return make_error("{}: window {} [{}, {}) must be non-empty inside [0, {})", who, what, begin, end, n);
    }
    return {};
}

// A K window other than the whole K must be whole canonical blocks (K / 8 columns) forming an aligned subtree.
inline Result<void> k_window(const char *who, int64_t k0, int64_t k1, int64_t k) {
    if (k0 == 0 && k1 == k) return {};
    constexpr int64_t kBlocks = 8;  // cpu::kCanonicalBlocks
    if (k % kBlocks != 0) {
        return make_error("{}: K window [{}, {}) of a matrix with K = {}, which has no {} canonical blocks", who, k0, k1,
                          k, kBlocks);
    }
    const int64_t bs = k / kBlocks;
    const int64_t m = (k1 - k0) / bs;
    if (k0 % bs != 0 || k1 % bs != 0 || !(m == 1 || m == 2 || m == 4 || m == 8) || (k0 / bs) % m != 0) {
        return make_error("{}: K window [{}, {}) is not an aligned subtree of the {} canonical blocks of {} columns (K "
                          "= {})",
                          who, k0, k1, kBlocks, bs, k);
    }
    return {};
}

// What every backend refuses of a matrix window: an unsupported dtype, an empty matrix or no data, an fp8 matrix
// without scale_inv, a non-positive block (the fp8 scale tile, also the exact K loop's chunk edge), an empty window
// or one outside the matrix, a K window that is not an aligned subtree of whole canonical blocks.
inline Result<void> matrix_upload(const char *who, const HostMatrix &m, const MatrixWindow &win) {
    if (!linear_dtype(m.dtype)) return make_error("{}: matrix dtype {} is not supported", who, dtype_name(m.dtype));
    if (m.rows <= 0 || m.cols <= 0 || m.data == nullptr) {
        return make_error("{}: matrix [{}, {}] must be non-empty with data", who, m.rows, m.cols);
    }
    if (m.dtype == DType::kF8E4M3 && (m.scale_inv == nullptr || m.block_rows < 1 || m.block_cols < 1)) {
        return make_error("{}: F8_E4M3 matrix [{}, {}] needs scale_inv and positive block sizes", who, m.rows, m.cols);
    }
    if (m.block_rows < 1 || m.block_cols < 1) {
        return make_error("{}: matrix [{}, {}] has blocks [{}, {}]; the K loop's chunk edge must be positive", who,
                          m.rows, m.cols, m.block_rows, m.block_cols);
    }
    if (auto ok = window_axis(who, "rows", win.row_begin, win.row_end, m.rows); !ok) return ok;
    if (auto ok = window_axis(who, "columns", win.col_begin, win.col_end, m.cols); !ok) return ok;
    return k_window(who, win.col_begin, win.col_end, m.cols);
}

// The same for an expert bank and its expert window.
inline Result<void> bank_upload(const char *who, const HostBank &b, const BankWindow &win) {
    if (!linear_dtype(b.dtype)) return make_error("{}: expert bank dtype {} is not supported", who, dtype_name(b.dtype));
    if (b.n_experts <= 0 || b.rows <= 0 || b.cols <= 0 || b.data == nullptr) {
        return make_error("{}: expert bank [{}, {}, {}] must be non-empty with data", who, b.n_experts, b.rows, b.cols);
    }
    if (b.dtype == DType::kF8E4M3 && (b.scale_inv == nullptr || b.block_rows < 1 || b.block_cols < 1)) {
        return make_error("{}: F8_E4M3 expert bank [{}, {}, {}] needs scale_inv and positive block sizes", who,
                          b.n_experts, b.rows, b.cols);
    }
    if (b.block_rows < 1 || b.block_cols < 1) {
        return make_error("{}: expert bank [{}, {}, {}] has blocks [{}, {}]; the K loop's chunk edge must be positive",
                          who, b.n_experts, b.rows, b.cols, b.block_rows, b.block_cols);
    }
    return window_axis(who, "experts", win.expert_begin, win.expert_end, b.n_experts);
}

// ---- Ops ----

inline void same_shape(const char *op, const TensorView &a, const TensorView &b) {
    MEMRA_CHECK(a.rows() == b.rows() && a.row_elems() == b.row_elems(), "{}: views [{}, {}] and [{}, {}] differ", op,
                a.rows(), a.row_elems(), b.rows(), b.row_elems());
}

// A norm weight of n values for rows of x.
inline void norm_weight(const char *op, int64_t n, const TensorView &x) {
    MEMRA_CHECK(n == x.row_elems(), "{}: weight [{}] for rows of {}", op, n, x.row_elems());
}

inline void rms_norm_heads(const TensorView &x, int64_t n_heads, int64_t head_dim, int64_t w_n) {
    MEMRA_CHECK(w_n == head_dim && x.row_elems() == n_heads * head_dim, "rms_norm_heads: weight [{}], rows of {}", w_n,
                x.row_elems());
}

// y = x . W^T with W [w_rows, w_cols] (the held part).
inline void matmul(const char *op, const TensorView &x, int64_t w_rows, int64_t w_cols, const TensorView &y) {
    MEMRA_CHECK(x.row_elems() == w_cols && y.rows() == x.rows() && y.row_elems() == w_rows,
                "{}: x [{}, {}], W [{}, {}], y [{}, {}]", op, x.rows(), x.row_elems(), w_rows, w_cols, y.rows(),
                y.row_elems());
}

// A grouped product over a bank of n_experts [rows, cols] experts from first_expert.
inline void grouped(const char *op, const TensorView &x, int64_t n_experts, int64_t rows, int64_t cols,
                    int64_t first_expert, const TensorView &offsets, const TensorView &y) {
    MEMRA_CHECK(offsets.numel() >= first_expert + n_experts + 1 && x.row_elems() == cols && y.rows() == x.rows() &&
                    y.row_elems() == rows,
                "{}: x [{}, {}], bank [{}, {}, {}] from expert {}, {} offsets, y [{}, {}]", op, x.rows(), x.row_elems(),
                n_experts, rows, cols, first_expert, offsets.numel(), y.rows(), y.row_elems());
}

inline void rope(const TensorView &x, int64_t n_heads, int64_t head_dim, const TensorView &positions) {
    MEMRA_CHECK(positions.numel() == x.rows() && x.row_elems() == n_heads * head_dim,
                "rope: {} positions for x [{}, {}]", positions.numel(), x.rows(), x.row_elems());
}

// layer_row_elems: the K/V values per position the pool's layer holds.
inline void paged_attention(const AttentionParams &p, const TensorView &q, const TensorView &q_pos,
                            const TensorView &q_seq, int layer, int64_t layer_row_elems, const TensorView &block_tables,
                            const TensorView &gate, const TensorView &out) {
    const int64_t row = p.n_heads * p.head_dim;
    MEMRA_CHECK(block_tables.rank == 2, "paged_attention: block tables must be [n_seqs, max_blocks], rank {}",
                block_tables.rank);
    MEMRA_CHECK(q.row_elems() == row && out.row_elems() == row && out.rows() == q.rows() && q_pos.numel() == q.rows() &&
                    q_seq.numel() == q.rows() && layer_row_elems == p.n_kv_heads * p.head_dim,
                "paged_attention: q [{}, {}], {} positions, {} sequences, out [{}, {}], pool layer {} of {} values",
                q.rows(), q.row_elems(), q_pos.numel(), q_seq.numel(), out.rows(), out.row_elems(), layer,
                layer_row_elems);
    MEMRA_CHECK(gate.data == nullptr || (gate.rows() == q.rows() && gate.row_elems() == p.n_heads),
                "paged_attention: gate [{}, {}]", gate.rows(), gate.row_elems());
}

inline void kv_write(const TensorView &k, const TensorView &v, const TensorView &slots, int layer, int64_t row_elems) {
    same_shape("kv_write", k, v);
    MEMRA_CHECK(k.row_elems() == row_elems && slots.numel() == k.rows(),
                "kv_write: k [{}, {}], {} slots, layer {} rows of {} values", k.rows(), k.row_elems(), slots.numel(),
                layer, row_elems);
}

inline void router_topk(const RouterConfig &cfg, const TensorView &logits, DType bias_dtype, int64_t bias_n,
                        const TensorView &expert_ids, const TensorView &weights) {
    MEMRA_CHECK(bias_dtype == DType::kF32 && bias_n == cfg.n_experts, "router_topk: bias must be [{}] F32",
                cfg.n_experts);
    MEMRA_CHECK(logits.row_elems() == cfg.n_experts && expert_ids.numel() == logits.rows() * cfg.top_k &&
                    weights.numel() == logits.rows() * cfg.top_k,
                "router_topk: logits [{}, {}] for {} experts top {}", logits.rows(), logits.row_elems(), cfg.n_experts,
                cfg.top_k);
}

inline void moe_sort_pairs(const TensorView &expert_ids, int64_t n_experts, const TensorView &offsets,
                           const TensorView &sorted_pair, const TensorView &row_of_pair) {
    MEMRA_CHECK(offsets.numel() == n_experts + 1 && sorted_pair.numel() == expert_ids.numel() &&
                    row_of_pair.numel() == expert_ids.numel(),
                "moe_sort_pairs: {} pairs, {} offsets for {} experts", expert_ids.numel(), offsets.numel(), n_experts);
}

inline void moe_permute(const TensorView &x, const TensorView &sorted_pair, const TensorView &offsets,
                        int64_t expert_begin, int64_t expert_end, int64_t top_k, const TensorView &x_own) {
    MEMRA_CHECK(0 <= expert_begin && expert_begin <= expert_end && expert_end < offsets.numel() &&
                    sorted_pair.numel() == x.rows() * top_k && x_own.row_elems() == x.row_elems(),
                "moe_permute: x [{}, {}], {} pairs, experts [{}, {}) of {} offsets, x_own [{}, {}]", x.rows(),
                x.row_elems(), sorted_pair.numel(), expert_begin, expert_end, offsets.numel(), x_own.rows(),
                x_own.row_elems());
}

inline void moe_source_rows(const TensorView &expert_ids, const TensorView &row_of_pair, const TensorView &offsets,
                            int64_t n_owners, int64_t capacity, const TensorView &src_row) {
    const int64_t n_experts = offsets.numel() - 1;
    MEMRA_CHECK(n_owners >= 1 && n_experts % n_owners == 0 && capacity >= 0 &&
                    row_of_pair.numel() == expert_ids.numel() && src_row.numel() == expert_ids.numel(),
                "moe_source_rows: {} pairs, {} experts over {} owners, {} source rows", expert_ids.numel(), n_experts,
                n_owners, src_row.numel());
}

inline void moe_combine(const TensorView &h, const TensorView &expert_out, const TensorView &src_row,
                        const TensorView &weights, const TensorView &shared, const TensorView &out) {
    same_shape("moe_combine", h, out);
    MEMRA_CHECK(weights.rows() == h.rows() && expert_out.row_elems() == h.row_elems() &&
                    src_row.numel() == h.rows() * weights.row_elems(),
                "moe_combine: h [{}, {}], expert_out [{}, {}], weights [{}, {}], {} source rows", h.rows(),
                h.row_elems(), expert_out.rows(), expert_out.row_elems(), weights.rows(), weights.row_elems(),
                src_row.numel());
    if (shared.data != nullptr) same_shape("moe_combine", h, shared);
}

inline void gather_rows(const TensorView &src, const TensorView &rows, const TensorView &dst) {
    MEMRA_CHECK(dst.rows() == rows.numel() && dst.row_elems() == src.row_elems() && dst.dtype == src.dtype,
                "gather_rows: src [{}, {}], {} rows, dst [{}, {}]", src.rows(), src.row_elems(), rows.numel(),
                dst.rows(), dst.row_elems());
}

inline void scatter_rows(const TensorView &src, const TensorView &rows, const TensorView &dst) {
    MEMRA_CHECK(src.rows() == rows.numel() && dst.row_elems() == src.row_elems() && dst.dtype == src.dtype,
                "scatter_rows: src [{}, {}], {} rows, dst [{}, {}]", src.rows(), src.row_elems(), rows.numel(),
                dst.rows(), dst.row_elems());
}

// Returns the number of SampledToken records in tokens.
inline int64_t scatter_ids(const TensorView &tokens, const TensorView &pairs, const TensorView &dst) {
    MEMRA_CHECK(tokens.dtype == DType::kU8 && tokens.n_bytes() % sizeof(SampledToken) == 0 &&
                    pairs.dtype == DType::kI32 && pairs.numel() % 2 == 0 && dst.dtype == DType::kI32,
                "scatter_ids: {} token bytes, {} pair entries, dst {}", tokens.n_bytes(), pairs.numel(),
                dtype_name(dst.dtype));
    return static_cast<int64_t>(tokens.n_bytes() / sizeof(SampledToken));
}

inline void concat_cols(const TensorView &a, const TensorView &b, const TensorView &out) {
    MEMRA_CHECK(a.rows() == b.rows() && out.rows() == a.rows() && out.row_elems() == a.row_elems() + b.row_elems() &&
                    a.dtype == out.dtype && b.dtype == out.dtype,
                "concat_cols: a [{}, {}], b [{}, {}], out [{}, {}]", a.rows(), a.row_elems(), b.rows(), b.row_elems(),
                out.rows(), out.row_elems());
}

inline void canonical_combine(const TensorView &subtree_sums, const TensorView &out) {
    MEMRA_CHECK(subtree_sums.row_elems() == out.numel(), "canonical_combine: sums [{}, {}] for out [{}, {}]",
                subtree_sums.rows(), subtree_sums.row_elems(), out.rows(), out.row_elems());
}

inline void join_col_shards(const TensorView &shards, const TensorView &out) {
    MEMRA_CHECK(shards.rank == 3 && shards.dtype == out.dtype, "join_col_shards: shards must be [n_shards, n, w]");
    MEMRA_CHECK(out.rows() == shards.dim(1) && out.row_elems() == shards.dim(0) * shards.dim(2),
                "join_col_shards: shards [{}, {}, {}], out [{}, {}]", shards.dim(0), shards.dim(1), shards.dim(2),
                out.rows(), out.row_elems());
}

// Returns the number of rows to sample; workspace_vocab: the ids prepare_sampling sized for (0: not called).
inline int64_t sample(const TensorView &logits, int32_t n_valid, const TensorView &rows, const TensorView &bias,
                      const TensorView &out, int32_t workspace_vocab) {
    MEMRA_CHECK(workspace_vocab > 0, "sample: prepare_sampling was not called");
    MEMRA_CHECK(bias.dtype == DType::kU8 && bias.n_bytes() % sizeof(LogitBias) == 0,
                "sample: bias of {} {} bytes, expected kU8 LogitBias records of {} bytes", bias.n_bytes(),
                dtype_name(bias.dtype), sizeof(LogitBias));
    MEMRA_CHECK(rows.dtype == DType::kU8 && out.dtype == DType::kU8 && rows.n_bytes() % sizeof(SampleRow) == 0 &&
                    out.n_bytes() == rows.n_bytes() / sizeof(SampleRow) * sizeof(SampledToken),
                "sample: {} row bytes, {} out bytes", rows.n_bytes(), out.n_bytes());
    MEMRA_CHECK(n_valid >= 1 && n_valid <= logits.row_elems() && n_valid <= workspace_vocab,
                "sample: {} valid ids of logits rows of {} (workspace {})", n_valid, logits.row_elems(),
                workspace_vocab);
    return static_cast<int64_t>(rows.n_bytes() / sizeof(SampleRow));
}

}  // namespace memra::op_checks
