// The op set of the Step-3.5 forward pass as an interface (ARCHITECTURE.md "The op set"). The forward
// recipe (model/step35_forward) is written once against it; a backend (cpu/ now, cuda/ later) implements
// it. Activations are f32 buffers the backend allocates at prepare time (TensorView); weights are uploaded
// once and named by opaque handles; every op states its meaning by reference to the CPU kernel that
// defines it (backend/cpu/ops_*.h, backend/cpu/matmul.h). The backend counts its work per step.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>

#include "core/dtype.h"
#include "core/function_ref.h"
#include "core/kv_page.h"
#include "core/result.h"
#include "core/sampling.h"
#include "core/tensor.h"

namespace memra {

// What a backend's products and attention compute (ENGINE.md section 4, DETERMINISM.md rule 10). Both modes
// are deterministic and pass every gate.
enum class Numerics : uint8_t {
    kDevice,  // what tensor cores compute: bf16 activations before bf16-weight products, e4m3 groups of 128
              // before FP8 experts, the blocked attention order with bf16 q/k, P and V (the default)
    kExact,   // f32 activations everywhere: the reference of the model-math oracles (transformers, numpy)
};

inline const char *numerics_name(Numerics n) { return n == Numerics::kExact ? "exact" : "device"; }

// ---- Weights as they lie in host memory (a mapped checkpoint): what the upload methods read. ----

// A PyTorch linear weight [rows, cols] (out, in), row-major, or an embedding table [vocab, d_model].
struct HostMatrix {
    DType dtype = DType::kBF16;        // kF32, kBF16, kF16 or kF8E4M3
    const void *data = nullptr;        // [rows, cols] dtype
    int64_t rows = 0;
    int64_t cols = 0;
    const float *scale_inv = nullptr;  // kF8E4M3 only: [ceil(rows / block_rows), ceil(cols / block_cols)] f32
    int64_t block_rows = 128;          // fp8 scale block (weight_block_size)
    int64_t block_cols = 128;
    bool f32_activations = false;      // products keep f32 activations in every numerics mode (the router)
};

// A stacked expert bank [n_experts, rows, cols]; fp8 scales [n_experts, ceil(rows / 128), ceil(cols / 128)].
struct HostBank {
    DType dtype = DType::kBF16;
    const void *data = nullptr;
    int64_t n_experts = 0;
    int64_t rows = 0;
    int64_t cols = 0;
    const float *scale_inv = nullptr;
    int64_t block_rows = 128;
    int64_t block_cols = 128;
};

// The part of a HostMatrix one upload holds: what a tensor-parallel rank keeps of it (parallel/plan).
// Output rows [row_begin, row_end) are a column-parallel shard (heads, d_ff, vocabulary rows); K columns
// [col_begin, col_end) a row-parallel shard, which must be whole canonical blocks (K / 8 columns each)
// forming an aligned subtree of the canonical tree (1, 2, 4 or 8 blocks, starting at a multiple of their
// count). The held part keeps the matrix's absolute positions (fp8 scale tiles, K chunk cuts, block
// numbers), so every product over it gives exactly the TP = 1 values of its part.
struct MatrixWindow {
    int64_t row_begin = 0;
    int64_t row_end = 0;
    int64_t col_begin = 0;
    int64_t col_end = 0;

    static MatrixWindow whole(const HostMatrix &m) { return MatrixWindow{0, m.rows, 0, m.cols}; }
};

// The part of a HostBank one upload holds: experts [expert_begin, expert_end), whole (a TP rank's own experts;
// routed experts are never split by width, ENGINE.md section 3).
struct BankWindow {
    int64_t expert_begin = 0;
    int64_t expert_end = 0;

    static BankWindow whole(const HostBank &b) { return BankWindow{0, b.n_experts}; }
};

// A vector: an RMSNorm weight (kBF16 or kF32, applied as (1 + w)) or the router's selection bias (kF32).
struct HostVector {
    DType dtype = DType::kBF16;
    const void *data = nullptr;  // [n] dtype
    int64_t n = 0;
};

// Opaque handles issued by one backend; using a handle with another backend is a programming error.
struct MatrixId {
    int32_t id = -1;
    bool valid() const { return id >= 0; }
};
struct BankId {
    int32_t id = -1;
    bool valid() const { return id >= 0; }
};
struct VectorId {
    int32_t id = -1;
    bool valid() const { return id >= 0; }
};
struct RopeId {
    int32_t id = -1;
    bool valid() const { return id >= 0; }
};
struct KvPoolId {
    int32_t id = -1;
    bool valid() const { return id >= 0; }
};

// llama3 RoPE frequency scaling (STEP35.md 4.3 item 4).
struct RopeScalingParams {
    double factor = 1.0;
    double low_freq_factor = 1.0;
    double high_freq_factor = 1.0;
    double original_max_position_embeddings = 0.0;
};

struct AttentionParams {
    int64_t n_heads = 0;     // query heads, a multiple of n_kv_heads
    int64_t n_kv_heads = 0;
    int64_t head_dim = 0;
    int64_t window = 0;      // sliding window incl. the current position; 0 = full causal
};

// What the attention query is rounded to before its dot products with the keys (Backend::round_rows):
// GGML's semantics, where a key type's dot product takes the other operand in that type's partner type
// (vec_dot_type), so a memra KV cache gives the bits' meaning llama.cpp gives the same cache type.
enum class RowRounding {
    kNone,  // f32 keys: the query as computed
    kBf16,  // bf16 keys: the query rounded to bf16 (nearest even)
    kQ8,    // q8_0 keys (partner q8_0) and q5_1 keys (partner q8_1, the same values): GGML q8_0 blocks of 32
};

// A layer's attention inputs for a step (Backend::attention_prologue): q [n, n_heads * head_dim], k and v
// [n, n_kv_heads * head_dim] f32; the per-head norm weights; the RoPE table (invalid: no rotation) and the rows'
// positions [n] i64; the K/V pool, its layer and the rows' slots [n] i32; the query's rounding for the keys.
struct AttentionInputs {
    TensorView q, k, v;
    int64_t n_heads = 0;
    int64_t n_kv_heads = 0;
    int64_t head_dim = 0;
    VectorId q_norm, k_norm;
    float eps = 0.0f;
    RopeId table;
    TensorView positions;
    KvPoolId pool;
    int layer = 0;
    TensorView slots;
    RowRounding q_round = RowRounding::kNone;
};

struct RouterConfig {
    int64_t n_experts = 0;
    int64_t top_k = 0;
    bool renormalize = true;
    float scaling_factor = 1.0f;
};

// What Backend::moe_route writes, and the owners' layout of its source rows (moe_source_rows). logits: [n,
// n_experts] f32; expert_ids, weights: [n, top_k]; offsets: [n_experts + 1] i32; sorted_pair, row_of_pair,
// src_row: [n * top_k] i32.
struct MoeRouteViews {
    TensorView logits;
    TensorView expert_ids;
    TensorView weights;
    TensorView offsets;
    TensorView sorted_pair;
    TensorView row_of_pair;
    TensorView src_row;
    int64_t n_owners = 1;
    int64_t capacity = 0;
};

// Work done since the last reset: one launch per op call (a CUDA backend issues one kernel per op), one
// host copy per transfer between host memory and backend buffers (inputs, KV rows, logits).
struct BackendCounters {
    int64_t launches = 0;
    int64_t h2d_copies = 0;  // host -> backend transfers
    int64_t d2h_copies = 0;  // backend -> host transfers (each one waits for the work before it)
    int64_t copy_bytes = 0;  // bytes of both

    int64_t host_copies() const { return h2d_copies + d2h_copies; }
};

class Backend {
public:
    virtual ~Backend() = default;

    virtual const char *name() const = 0;
    virtual Device device() const = 0;
    virtual Numerics numerics() const = 0;

    // ---- Prepare time (allocate, upload); never called on the hot path. ----

    // A zero-filled buffer of the given shape, owned by the backend until it is destroyed.
    virtual Result<TensorView> alloc(DType dtype, std::initializer_list<int64_t> shape) = 0;
    // Whether uploaded weights stay views of the host memory they were uploaded from (CPU: zero-copy, so that
    // memory must outlive the backend) rather than copies made before the upload returns (CUDA). The binder gives
    // each tensor back to its io::TensorStore after the upload when this is false, so a model generated in memory
    // is never whole in host memory; the default is the safe answer.
    virtual bool keeps_host_views() const { return true; }
    // Weight uploads (CPU: zero-copy views; the host memory must outlive the backend). Refused: an
    // unsupported dtype, non-positive sizes, a missing fp8 scale.
    virtual Result<MatrixId> upload_matrix(const HostMatrix &m) = 0;
    virtual Result<BankId> upload_bank(const HostBank &b) = 0;
    // A window of a matrix or bank (a TP rank's shard; the whole one uploads as upload_matrix / upload_bank).
    // Refused besides: an empty window or one outside the tensor, a K window that is not an aligned subtree
    // of whole canonical blocks. A K-windowed matrix serves only the row-parallel products.
    virtual Result<MatrixId> upload_matrix_window(const HostMatrix &m, const MatrixWindow &w) = 0;
    virtual Result<BankId> upload_bank_window(const HostBank &b, const BankWindow &w) = 0;
    virtual Result<VectorId> upload_vector(const HostVector &v) = 0;
    // The cos/sin table of one RoPE variant for positions [0, n_positions), built on the host
    // (cpu::rope_inv_freq, cpu::rope_table_build) and made resident. llama3 == nullptr: plain RoPE.
    virtual Result<RopeId> create_rope_table(int64_t rot_dim, double theta, const RopeScalingParams *llama3,
                                             int64_t n_positions) = 0;
    // Floats of workspace matmul_canonical needs for n_rows rows of w (scaled to the blocks w holds).
    virtual int64_t canonical_workspace_floats(int64_t n_rows, MatrixId w) const = 0;

    // A zero-filled paged KV pool (core/kv_page.h layout). Refused: a bad spec, an allocation failure.
    virtual Result<KvPoolId> create_kv_pool(const KvPoolSpec &spec) = 0;
    // The pool's bytes as one [pool bytes] kU8 view (for copies of single rows; verification only).
    virtual TensorView kv_pool_storage(KvPoolId pool) const = 0;
    // Sizes the sampling op's workspace for rows of up to vocab_size logits.
    virtual Result<void> prepare_sampling(int32_t vocab_size) = 0;

    // Makes the calling thread one that may issue this backend's work (CUDA: the backend's GPU current); the
    // engine calls it on each rank's thread before the rank's step.
    virtual void bind_thread() {}

    // ---- Host transfers (counted as host copies). ----

    // dst.numel() elements of dst.dtype from host memory src.
    virtual void copy_from_host(const void *src, TensorView dst) = 0;
    // src.numel() elements of src.dtype into host memory dst.
    virtual void copy_to_host(TensorView src, void *dst) = 0;

    // ---- Ops (each one launch). Activations are f32 unless stated; views carry the row count. ----

    // out[t, :] = table[ids[t], :] widened to f32. ids: [n] i32; out: [n, d_model]. Error: id out of range.
    virtual Result<void> embedding(MatrixId table, TensorView ids, TensorView out) = 0;
    // RMSNorm (1 + w) per row: cpu::rms_norm. x, y: [n, d]; y may equal x.
    virtual void rms_norm(TensorView x, VectorId w, float eps, TensorView y) = 0;
    // Per-head RMSNorm in place over x [n, n_heads * head_dim]: cpu::rms_norm_heads.
    virtual void rms_norm_heads(TensorView x, int64_t n_heads, int64_t head_dim, VectorId w, float eps) = 0;
    // h = x + r; y = rms_norm(h): cpu::add_rms_norm. h may equal x or r.
    virtual void add_rms_norm(TensorView x, TensorView r, VectorId w, float eps, TensorView h, TensorView y) = 0;
    // out = a + b: cpu::residual_add. out may equal a or b.
    virtual void residual_add(TensorView a, TensorView b, TensorView out) = 0;
    // Column-parallel product y = x . W^T (cpu::matmul). x: [n, cols]; y: [n, rows].
    virtual void matmul(TensorView x, MatrixId w, TensorView y) = 0;
    // Column-parallel products of one x by several matrices (the attention's q, k, v and gate; an MLP's gate and
    // up): y[i] = matmul(x, w[i], y[i]) bit for bit, whatever the backend fuses (CUDA: up to 4 bf16 products in
    // one launch). Here: one by one.
    virtual void matmul_multi(TensorView x, std::span<const MatrixId> w, std::span<const TensorView> y) {
        MEMRA_CHECK(w.size() == y.size(), "matmul_multi: {} matrices but {} outputs", w.size(), y.size());
        for (size_t i = 0; i < w.size(); ++i) matmul(x, w[i], y[i]);
    }
    // Row-parallel product over the canonical K blocks w holds (cpu::matmul_canonical): all 8 for a whole
    // matrix (the TP = 1 product), the rank's aligned subtree sum for a K window (finished across ranks by
    // canonical_combine). x: [n, K columns held]; y: [n, rows]; workspace: canonical_workspace_floats(n, w).
    virtual void matmul_canonical(TensorView x, MatrixId w, TensorView y, TensorView workspace) = 0;
    // Grouped product over the experts bank b holds, [e0, e1) (all of them for a whole bank), in its owner's
    // compact row order: expert e's rows are offsets[e] - offsets[e0] .. offsets[e + 1] - offsets[e0] of x and
    // y, and each goes through expert e whole, the canonical K loop over the full K (cpu::matmul) — gate and
    // up, and the down projection too (one K order, ENGINE.md section 3). x: [rows >= offsets[e1] -
    // offsets[e0], cols]; offsets: [n_experts + 1] i32 over every expert of the layer, read by the op (no host
    // read); y: [x rows, rows held]. Rows past offsets[e1] - offsets[e0] are left untouched.
    virtual void matmul_grouped(TensorView x, BankId b, TensorView offsets, TensorView y) = 0;
    // The routed experts' gate and up on one x: matmul_grouped(x, a, offsets, y_a) and (x, b, offsets, y_b) bit for
    // bit, whatever the backend fuses (CUDA: e4m3 banks of one shape share one quantization and one launch). Here:
    // one after the other.
    virtual void matmul_grouped_pair(TensorView x, BankId a, BankId b, TensorView offsets, TensorView y_a,
                                     TensorView y_b) {
        matmul_grouped(x, a, offsets, y_a);
        matmul_grouped(x, b, offsets, y_b);
    }
    // The routed experts' down product on their activation: swiglu(gate, up, limit, gate) (gate holds the
    // activation afterwards), then matmul_grouped(gate, b, offsets, y), bit for bit whatever the backend fuses
    // (CUDA: an e4m3 bank's quantization forms the activation, with no launch of its own). Here: one after the
    // other.
    virtual void matmul_grouped_swiglu(TensorView gate, TensorView up, float limit, BankId b, TensorView offsets,
                                       TensorView y) {
        swiglu(gate, up, limit, gate);
        matmul_grouped(gate, b, offsets, y);
    }
    // Finishes row-parallel products from the TP ranks' subtree sums, gathered in rank order
    // (cpu::canonical_tree_combine): out = the canonical tree over them. subtree_sums: [tp, ...] with tp
    // 1, 2, 4 or 8, each rank's slot holding out.numel() values ([n, d] row-major); out: [n, d].
    virtual void canonical_combine(TensorView subtree_sums, TensorView out) = 0;
    // Joins column shards gathered in rank order (exact copies): out[t, s * w + j] = shards[s, t, j].
    // shards: [n_shards, n, w]; out: [n, n_shards * w]. (The LM head's vocabulary slices -> [n, vocab].)
    virtual void join_col_shards(TensorView shards, TensorView out) = 0;
    // NeoX RoPE in place over dims [0, rot_dim) of every head: cpu::rope_apply. x: [n, n_heads * head_dim];
    // positions: [n] i64, each inside the table (an invariant the caller checks).
    virtual void rope(RopeId table, TensorView x, int64_t n_heads, int64_t head_dim, TensorView positions) = 0;
    // The attention's per-head RMSNorms and RoPE: rms_norm_heads(q, n_heads, head_dim, q_norm), the same for k,
    // then, when `table` is valid, rope(table, q, ...) and rope(table, k, ...), bit for bit (CUDA: one launch).
    // Here: those calls in that order.
    virtual void qk_norm_rope(TensorView q, int64_t n_heads, VectorId q_norm, TensorView k, int64_t n_kv_heads,
                              VectorId k_norm, int64_t head_dim, float eps, RopeId table, TensorView positions) {
        rms_norm_heads(q, n_heads, head_dim, q_norm, eps);
        rms_norm_heads(k, n_kv_heads, head_dim, k_norm, eps);
        if (table.valid()) {
            rope(table, q, n_heads, head_dim, positions);
            rope(table, k, n_kv_heads, head_dim, positions);
        }
    }
    // The inputs of a layer's attention for a step: qk_norm_rope(q, k), kv_write(pool, layer, k, v, slots), then
    // round_rows(q, q_round), bit for bit (CUDA: one launch). Here: those calls in that order.
    virtual void attention_prologue(const AttentionInputs &a) {
        qk_norm_rope(a.q, a.n_heads, a.q_norm, a.k, a.n_kv_heads, a.k_norm, a.head_dim, a.eps, a.table, a.positions);
        kv_write(a.pool, a.layer, a.k, a.v, a.slots);
        round_rows(a.q, a.q_round);
    }
    // Causal (+ sliding window) GQA attention over a paged KV pool, for every sequence of a step at once,
    // with the optional per-head sigmoid gate: cpu::paged_attention. Query row i (position q_pos[i], step
    // sequence q_seq[i]) sees the keys of its own sequence at positions [lo, q_pos[i]], lo = max(first_pos,
    // q_pos[i] - window + 1) on a sliding layer and first_pos on a full one, read back through the pool's
    // formats (keys and values decoded exactly as stored: DETERMINISM.md rule 9). Position p of sequence s
    // lives in page block_tables[s, p / 64], row p % 64 of `layer`; every visible position must have a page.
    // q: [n, n_heads * head_dim]; q_pos: [n] i64; q_seq: [n] i32; block_tables: [n_seqs, max_blocks] i32;
    // gate: [n, n_heads] raw logits, or a view with data == nullptr; out: [n, n_heads * head_dim].
    virtual void paged_attention(const AttentionParams &p, TensorView q, TensorView q_pos, TensorView q_seq,
                                 KvPoolId pool, int layer, TensorView block_tables, int64_t first_pos, TensorView gate,
                                 TensorView out) = 0;
    // Encodes the step's new K and V rows into their slots of `layer` in the pool's formats (slot = page * 64
    // + position % 64): cpu::kv_write. k, v: [n, row_elems] f32; slots: [n] i32.
    virtual void kv_write(KvPoolId pool, int layer, TensorView k, TensorView v, TensorView slots) = 0;
    // x rounded in place (RowRounding; kNone leaves it untouched): cpu::round_rows. x: [n, d] f32, d a
    // multiple of 32 for kQ8.
    virtual void round_rows(TensorView x, RowRounding r) = 0;
    // SwiGLU with the Step clamp (limit 0 = off): cpu::swiglu. gate, up, out: [n, d_ff].
    virtual void swiglu(TensorView gate, TensorView up, float limit, TensorView out) = 0;
    // Sigmoid top-k router with selection-only bias: cpu::router_topk. logits: [n, n_experts] f32;
    // expert_ids: [n, top_k] i32; weights: [n, top_k] f32.
    virtual void router_topk(const RouterConfig &cfg, TensorView logits, VectorId bias, TensorView expert_ids,
                             TensorView weights) = 0;
    // Stable counting sort of the (token, slot) pairs by expert: cpu::moe_sort_pairs.
    // offsets: [n_experts + 1] i32; sorted_pair, row_of_pair: [n * top_k] i32.
    virtual void moe_sort_pairs(TensorView expert_ids, int64_t n_experts, TensorView offsets, TensorView sorted_pair,
                                TensorView row_of_pair) = 0;
    // The input rows of the pairs routed to experts [expert_begin, expert_end), in sorted order:
    // x_own[j] = x[sorted_pair[offsets[expert_begin] + j] / top_k] for j < offsets[expert_end] -
    // offsets[expert_begin] (cpu::moe_permute); rows of x_own past that are left untouched.
    // x: [n, d]; sorted_pair: [n * top_k] i32; offsets: [n_experts + 1] i32; x_own: [rows, d].
    virtual void moe_permute(TensorView x, TensorView sorted_pair, TensorView offsets, int64_t expert_begin,
                             int64_t expert_end, int64_t top_k, TensorView x_own) = 0;
    // Where each pair's expert output lies once the owners' compact rows are gathered ([n_owners, capacity,
    // d] as rows): the owner of pair q's expert e is o = e / (n_experts / n_owners), and
    // src_row[q] = o * capacity + row_of_pair[q] - offsets[o * n_experts / n_owners]. Reads only backend
    // buffers (routing is replicated, so every rank knows every route without traffic).
    // expert_ids, row_of_pair, src_row: [n * top_k] i32; offsets: [n_experts + 1] i32.
    virtual void moe_source_rows(TensorView expert_ids, TensorView row_of_pair, TensorView offsets, int64_t n_owners,
                                 int64_t capacity, TensorView src_row) = 0;
    // One MoE layer's routing before its permute, as one op a backend may fuse (CUDA: one launch):
    // matmul(x, router, r.logits), router_topk(cfg, r.logits, bias, r.expert_ids, r.weights),
    // moe_sort_pairs(r.expert_ids, cfg.n_experts, r.offsets, r.sorted_pair, r.row_of_pair) and
    // moe_source_rows(r.expert_ids, r.row_of_pair, r.offsets, r.n_owners, r.capacity, r.src_row), bit for bit.
    // Here: those four ops.
    virtual void moe_route(TensorView x, MatrixId router, const RouterConfig &cfg, VectorId bias,
                           const MoeRouteViews &r) {
        matmul(x, router, r.logits);
        router_topk(cfg, r.logits, bias, r.expert_ids, r.weights);
        moe_sort_pairs(r.expert_ids, cfg.n_experts, r.offsets, r.sorted_pair, r.row_of_pair);
        moe_source_rows(r.expert_ids, r.row_of_pair, r.offsets, r.n_owners, r.capacity, r.src_row);
    }
    // out = h + (sum over slots of weight * expert_out[src_row[pair]] + shared): cpu::moe_combine, slot order.
    // expert_out: [rows, d] indexed through src_row ([n * top_k] i32); out may equal h.
    virtual void moe_combine(TensorView h, TensorView expert_out, TensorView src_row, TensorView weights,
                             TensorView shared, TensorView out) = 0;
    // dst[i, :] = src[rows[i], :] (exact copies). rows: [n_out] i32 on the backend.
    virtual void gather_rows(TensorView src, TensorView rows, TensorView dst) = 0;
    // dst[rows[i], :] = src[i, :] for every i with rows[i] >= 0 (exact copies; no two rows[i] equal). src: [n, d];
    // rows: [n] i32 on the backend; dst: [m, d].
    virtual void scatter_rows(TensorView src, TensorView rows, TensorView dst) = 0;
    // Writes sampled ids into i32 tables on the backend (speculative drafts feeding later rows of the same
    // run): dst[pairs[i, 1]] = tokens[pairs[i, 0]].id for every i. tokens: SampledToken array as kU8 bytes;
    // pairs: [n, 2] i32; dst: i32.
    virtual void scatter_ids(TensorView tokens, TensorView pairs, TensorView dst) = 0;
    // out[t] = [a[t] | b[t]] (exact copies). a: [n, da]; b: [n, db]; out: [n, da + db].
    virtual void concat_cols(TensorView a, TensorView b, TensorView out) = 0;

    // Samples one token per row (core/sampling.h: penalties, temperature, top-k / top-p / min-p, Gumbel-max
    // keyed by (seed, choice, position)), over the ids [0, n_valid) only, and the log-probabilities a row asks
    // for: out[i] = the SampledToken of rows[i]. logits: [L, vocab] f32; rows: [n] SampleRow as kU8 bytes;
    // history: i32 tokens the rows' penalty windows index; bias: LogitBias entries as kU8 bytes, the rows'
    // logit biases index (each row's range sorted by id, ids unique; applied before the penalties, the
    // log-probabilities unbiased); out: [n] SampledToken as kU8 bytes.
    virtual void sample(TensorView logits, int32_t n_valid, TensorView rows, TensorView history, TensorView bias,
                        TensorView out) = 0;

    // ---- A side branch (CUDA.md 4: streams joined by events) ----

    // Independent work may overlap: side_fork() marks the point the step's ops have reached; the ops issued
    // between side_begin() and side_end() run after that point, alongside the ops issued outside them since the
    // fork; side_join() orders every op issued after it after the branch. The caller promises that the branch
    // neither writes what the ops alongside it read or write nor reads what they write, so no bit depends on the
    // overlap. At most one branch is open: a fork joins the one before; a host copy waits for the branch's ops
    // issued so far, and the end of a recorded step closes and joins it. A backend without a side branch runs the
    // ops in issue order (the default).
    virtual void side_fork() {}
    virtual void side_begin() {}
    virtual void side_end() {}
    virtual void side_join() {}

    // ---- Step recording ----

    // Runs body, the ops of one step. A backend may record the ops body issues under `key` and, for a later call
    // with an equal key, replay the record instead of calling body (CudaBackend: CUDA graphs). The caller
    // guarantees that equal keys issue the same ops on the same buffers with the same host arguments (the key
    // holds every host-side value the ops depend on: shapes, buffer offsets, counts) and that body neither
    // copies to or from the host nor depends on host state it changes. The counters advance as if body ran.
    virtual Result<void> run_recorded(std::span<const int64_t> key, FunctionRef<Result<void>()> body) {
        (void)key;
        return body();
    }

    // The bytes per second a copy of `bytes` bytes within the backend's memory moves, reads and writes counted
    // (2 x bytes per copy), best of three after a warm-up: the memory ceiling a memory-bound step is held against
    // (`memra bench`'s roofline). Allocates and frees its buffers: never on the hot path, never inside a recorded
    // step. Refused: bytes < 1, buffers that cannot be allocated.
    virtual Result<double> copy_bandwidth(int64_t bytes) = 0;

    // ---- Counters ----
    virtual BackendCounters counters() const = 0;
    virtual void reset_counters() = 0;
};

}  // namespace memra
