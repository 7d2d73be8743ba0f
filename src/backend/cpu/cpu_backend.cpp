// CpuBackend: each op checks its views' shapes (programming errors abort with both shapes), counts one
// launch and calls the CPU reference kernel; weights stay where the caller mapped them.
#include "backend/cpu/cpu_backend.h"
#include "backend/op_checks.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <new>

#include "backend/cpu/ops.h"
#include "core/check.h"

namespace memra::cpu {

namespace {

float *f32(TensorView v) {
    MEMRA_CHECK(v.dtype == DType::kF32 && v.device == Device::kCpu, "cpu op: expected a host f32 view, got {}",
                dtype_name(v.dtype));
    return static_cast<float *>(v.data);
}

int32_t *i32(TensorView v) {
    MEMRA_CHECK(v.dtype == DType::kI32 && v.device == Device::kCpu, "cpu op: expected a host i32 view, got {}",
                dtype_name(v.dtype));
    return static_cast<int32_t *>(v.data);
}

int64_t *i64(TensorView v) {
    MEMRA_CHECK(v.dtype == DType::kI64 && v.device == Device::kCpu, "cpu op: expected a host i64 view, got {}",
                dtype_name(v.dtype));
    return static_cast<int64_t *>(v.data);
}

using op_checks::same_shape;

// The shape checks of a grouped product over bank bk (holding experts [e0, e1) of the layer); returns the
// offsets, whose expert e rows are [offsets[e] - offsets[e0], offsets[e + 1] - offsets[e0]) of x and y.
const int32_t *grouped_offsets(const char *op, TensorView x, const WeightBankRef &bk, TensorView offsets,
                               TensorView y) {
    const int32_t *off = i32(offsets);
    const int64_t e0 = bk.first_expert;
    const int64_t e1 = e0 + bk.n_experts;
    op_checks::grouped(op, x, bk.n_experts, bk.rows, bk.cols, e0, offsets, y);
    MEMRA_CHECK(off[e0] <= off[e1] && off[e1] - off[e0] <= x.rows(),
                "{}: experts [{}, {}) own {} rows, x holds {}", op, e0, e1, off[e1] - off[e0], x.rows());
    return off;
}

}  // namespace

CpuBackend::CpuBackend(int n_threads, Numerics numerics) : pool_(n_threads), numerics_(numerics) {}

CpuBackend::~CpuBackend() = default;

Result<double> CpuBackend::copy_bandwidth(int64_t bytes) {
    if (bytes < 1) return make_error("cpu copy bandwidth: {} bytes, expected >= 1", bytes);
    const auto n = static_cast<size_t>(bytes);
    // Value-initialized: every page touched before the timed copies.
    std::unique_ptr<std::byte[]> src(new (std::nothrow) std::byte[n]());
    std::unique_ptr<std::byte[]> dst(new (std::nothrow) std::byte[n]());
    if (!src || !dst) return make_error("cpu copy bandwidth: out of memory allocating 2 x {} bytes", bytes);
    double best = 0.0;
    for (int rep = 0; rep < 4; ++rep) {  // rep 0: the warm-up
        const auto t0 = std::chrono::steady_clock::now();
        pool_.parallel_for(
            bytes, [&](int64_t b, int64_t e) { std::memcpy(dst.get() + b, src.get() + b, static_cast<size_t>(e - b)); },
            int64_t{1} << 20);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (rep > 0 && s > 0.0) best = std::max(best, 2.0 * static_cast<double>(bytes) / s);
    }
    return best;
}

Result<TensorView> CpuBackend::alloc(DType dtype, std::initializer_list<int64_t> shape) {
    if (shape.size() < 1 || shape.size() > kTensorMaxRank) {
        return make_error("cpu alloc: rank {} outside [1, {}]", shape.size(), kTensorMaxRank);
    }
    TensorView v;
    v.dtype = dtype;
    v.device = Device::kCpu;
    v.rank = static_cast<int>(shape.size());
    size_t i = 0;
    for (int64_t d : shape) {
        if (d < 0) return make_error("cpu alloc: dimension {} is negative ({})", i, d);
        v.shape[i++] = d;
    }
    // At least one byte, so every view has a distinct non-null pointer even when empty.
    const size_t bytes = v.n_bytes() > 0 ? v.n_bytes() : 1;
    std::unique_ptr<std::byte[]> buf(new (std::nothrow) std::byte[bytes]());
    if (!buf) return make_error("cpu alloc: out of memory allocating {} bytes", bytes);
    v.data = buf.get();
    buffers_.push_back(std::move(buf));
    // Every activation a device product reads is a view into some f32 buffer, so the rounding scratch grows
    // with the largest one (here, at prepare time; never on the hot path).
    if (numerics_ == Numerics::kDevice && dtype == DType::kF32 && v.numel() > act_scratch_.codes_capacity) {
        act_codes_.resize(static_cast<size_t>(v.numel()));
        act_scales_.resize(static_cast<size_t>(v.numel()));
        act_scratch_ = ActScratch{act_codes_.data(), v.numel(), act_scales_.data(), v.numel()};
    }
    return v;
}

Result<void *> CpuBackend::panel_storage(int64_t bytes) {
    // Only the AVX512-BF16 path reads panels (matmul.h WeightPanels).
    if (bytes == 0 || !product_isa_supported(ProductIsa::kAvx512Bf16)) return nullptr;
    std::unique_ptr<std::byte[]> buf(new (std::nothrow) std::byte[static_cast<size_t>(bytes) + 64]);
    if (!buf) return make_error("out of memory allocating {} bytes of 16-row weight panels", bytes);
    void *at = buf.get() + (64 - reinterpret_cast<uintptr_t>(buf.get()) % 64) % 64;
    buffers_.push_back(std::move(buf));
    return at;
}

Result<MatrixId> CpuBackend::upload_matrix(const HostMatrix &m) {
    return upload_matrix_window(m, MatrixWindow::whole(m));
}

Result<MatrixId> CpuBackend::upload_matrix_window(const HostMatrix &m, const MatrixWindow &win) {
    if (auto ok = op_checks::matrix_upload("cpu upload", m, win); !ok) return tl::unexpected(ok.error());
    WeightRef w;
    w.dtype = m.dtype;
    w.data = m.data;
    w.rows = m.rows;
    w.cols = m.cols;
    w.scale_inv = m.scale_inv;
    w.block_rows = m.block_rows;
    w.block_cols = m.block_cols;
    w.act = numerics_ == Numerics::kDevice && m.dtype == DType::kBF16 && !m.f32_activations ? ActRounding::kBf16
                                                                                             : ActRounding::kNone;
    if (win.row_begin != 0 || win.row_end != m.rows) w = weight_row_slice(w, win.row_begin, win.row_end);
    if (win.col_begin != 0 || win.col_end != m.cols) w = weight_k_window(w, win.col_begin, win.col_end);
    if (auto at = panel_storage(device_panels_bytes(w)); !at) {
        return wrap_error("cpu upload", at.error());
    } else if (*at != nullptr) {
        w = device_panels_fill(pool_, w, *at);
    }
    matrices_.push_back(w);
    return MatrixId{static_cast<int32_t>(matrices_.size() - 1)};
}

Result<BankId> CpuBackend::upload_bank(const HostBank &b) { return upload_bank_window(b, BankWindow::whole(b)); }

Result<BankId> CpuBackend::upload_bank_window(const HostBank &b, const BankWindow &win) {
    if (auto ok = op_checks::bank_upload("cpu upload", b, win); !ok) return tl::unexpected(ok.error());
    WeightBankRef w;
    w.dtype = b.dtype;
    w.data = b.data;
    w.n_experts = b.n_experts;
    w.rows = b.rows;
    w.cols = b.cols;
    w.scale_inv = b.scale_inv;
    w.block_rows = b.block_rows;
    w.block_cols = b.block_cols;
    if (numerics_ == Numerics::kDevice && b.dtype == DType::kBF16) w.act = ActRounding::kBf16;
    if (numerics_ == Numerics::kDevice && b.dtype == DType::kF8E4M3 && b.block_cols == kE4m3Group) {
        w.act = ActRounding::kE4m3x128;
    }
    if (win.expert_begin != 0 || win.expert_end != b.n_experts) {
        w = weight_bank_window(w, win.expert_begin, win.expert_end);
    }
    if (auto at = panel_storage(w.n_experts * device_panels_bytes(weight_bank_expert(w, 0))); !at) {
        return wrap_error("cpu upload", at.error());
    } else if (*at != nullptr) {
        w = device_panels_fill(pool_, w, *at);
    }
    banks_.push_back(w);
    return BankId{static_cast<int32_t>(banks_.size() - 1)};
}

Result<VectorId> CpuBackend::upload_vector(const HostVector &v) {
    if (v.dtype != DType::kF32 && v.dtype != DType::kBF16) {
        return make_error("cpu upload: vector dtype {} is not supported (F32 or BF16)", dtype_name(v.dtype));
    }
    if (v.n <= 0 || v.data == nullptr) return make_error("cpu upload: vector [{}] must be non-empty with data", v.n);
    vectors_.push_back(v);
    return VectorId{static_cast<int32_t>(vectors_.size() - 1)};
}

Result<RopeId> CpuBackend::create_rope_table(int64_t rot_dim, double theta, const RopeScalingParams *llama3,
                                             int64_t n_positions) {
    RopeLlama3 l3;
    if (llama3 != nullptr) {
        l3.factor = llama3->factor;
        l3.low_freq_factor = llama3->low_freq_factor;
        l3.high_freq_factor = llama3->high_freq_factor;
        l3.original_max_position_embeddings = llama3->original_max_position_embeddings;
    }
    auto inv = rope_inv_freq(rot_dim, theta, llama3 != nullptr ? &l3 : nullptr);
    if (!inv) return tl::unexpected(inv.error());
    auto table = rope_table_build(pool_, *inv, n_positions);
    if (!table) return tl::unexpected(table.error());
    rope_tables_.push_back(std::move(*table));
    return RopeId{static_cast<int32_t>(rope_tables_.size() - 1)};
}

const WeightRef &CpuBackend::matrix(MatrixId id) const {
    MEMRA_CHECK(id.id >= 0 && static_cast<size_t>(id.id) < matrices_.size(), "cpu: unknown matrix handle {}", id.id);
    return matrices_[static_cast<size_t>(id.id)];
}

const WeightBankRef &CpuBackend::bank(BankId id) const {
    MEMRA_CHECK(id.id >= 0 && static_cast<size_t>(id.id) < banks_.size(), "cpu: unknown bank handle {}", id.id);
    return banks_[static_cast<size_t>(id.id)];
}

const HostVector &CpuBackend::host_vector(VectorId id) const {
    MEMRA_CHECK(id.id >= 0 && static_cast<size_t>(id.id) < vectors_.size(), "cpu: unknown vector handle {}", id.id);
    return vectors_[static_cast<size_t>(id.id)];
}

int64_t CpuBackend::canonical_workspace_floats(int64_t n_rows, MatrixId w) const {
    return matmul_canonical_workspace_floats(n_rows, matrix(w));
}

Result<KvPoolId> CpuBackend::create_kv_pool(const KvPoolSpec &spec) {
    auto layout = kv_page_layout(spec);
    if (!layout) return wrap_error("cpu KV pool", layout.error());
    auto storage = alloc(DType::kU8, {kv_pool_bytes(spec, *layout)});
    if (!storage) return wrap_error("cpu KV pool", storage.error());
    kv_pools_.push_back(KvPool{spec, std::move(*layout), *storage});
    return KvPoolId{static_cast<int32_t>(kv_pools_.size() - 1)};
}

const CpuBackend::KvPool &CpuBackend::kv_pool(KvPoolId id) const {
    MEMRA_CHECK(id.id >= 0 && static_cast<size_t>(id.id) < kv_pools_.size(), "cpu: unknown KV pool handle {}", id.id);
    return kv_pools_[static_cast<size_t>(id.id)];
}

TensorView CpuBackend::kv_pool_storage(KvPoolId pool) const { return kv_pool(pool).storage; }

PagedLayer CpuBackend::paged_layer(const KvPool &pool, int layer) const {
    return pool_layer(pool.spec, pool.layout, static_cast<std::byte *>(pool.storage.data), layer);
}

Result<void> CpuBackend::prepare_sampling(int32_t vocab_size) {
    auto s = Sampler::create(vocab_size, SamplingParams{});
    if (!s) return wrap_error("cpu sampling workspace", s.error());
    sampler_.emplace(std::move(*s));
    return {};
}

void CpuBackend::copy_from_host(const void *src, TensorView dst) {
    ++counters_.h2d_copies;
    counters_.copy_bytes += static_cast<int64_t>(dst.n_bytes());
    if (dst.n_bytes() > 0) std::memcpy(dst.data, src, dst.n_bytes());
}

void CpuBackend::copy_to_host(TensorView src, void *dst) {
    ++counters_.d2h_copies;
    counters_.copy_bytes += static_cast<int64_t>(src.n_bytes());
    if (src.n_bytes() > 0) std::memcpy(dst, src.data, src.n_bytes());
}

Result<void> CpuBackend::embedding(MatrixId table, TensorView ids, TensorView out) {
    ++counters_.launches;
    const WeightRef &w = matrix(table);
    MEMRA_CHECK(weight_has_full_k(w) && weight_ld(w) == w.cols && w.row_offset == 0,
                "embedding: the table must be uploaded whole");
    MEMRA_CHECK(ids.numel() == out.rows() && out.row_elems() == w.cols,
                "embedding: {} ids, out [{}, {}], table [{}, {}]",
                ids.numel(), out.rows(), out.row_elems(), w.rows, w.cols);
    return embedding_lookup(pool_, w.data, w.dtype, w.rows, w.cols, i32(ids), ids.numel(), f32(out));
}

void CpuBackend::rms_norm(TensorView x, VectorId w, float eps, TensorView y) {
    ++counters_.launches;
    same_shape("rms_norm", x, y);
    const HostVector &v = host_vector(w);
    op_checks::norm_weight("rms_norm", v.n, x);
    cpu::rms_norm(pool_, f32(x), x.rows(), x.row_elems(), NormWeight{v.data, v.dtype, true}, eps, f32(y));
}

void CpuBackend::rms_norm_heads(TensorView x, int64_t n_heads, int64_t head_dim, VectorId w, float eps) {
    ++counters_.launches;
    const HostVector &v = host_vector(w);
    op_checks::rms_norm_heads(x, n_heads, head_dim, v.n);
    cpu::rms_norm_heads(pool_, f32(x), x.rows(), x.row_elems(), n_heads, head_dim, NormWeight{v.data, v.dtype, true},
                        eps);
}

void CpuBackend::add_rms_norm(TensorView x, TensorView r, VectorId w, float eps, TensorView h, TensorView y) {
    ++counters_.launches;
    same_shape("add_rms_norm", x, r);
    same_shape("add_rms_norm", x, h);
    same_shape("add_rms_norm", x, y);
    const HostVector &v = host_vector(w);
    op_checks::norm_weight("add_rms_norm", v.n, x);
    cpu::add_rms_norm(pool_, f32(x), f32(r), x.rows(), x.row_elems(), NormWeight{v.data, v.dtype, true}, eps, f32(h),
                      f32(y));
}

void CpuBackend::residual_add(TensorView a, TensorView b, TensorView out) {
    ++counters_.launches;
    same_shape("residual_add", a, b);
    same_shape("residual_add", a, out);
    cpu::residual_add(pool_, f32(a), f32(b), a.rows(), a.row_elems(), f32(out));
}

void CpuBackend::matmul(TensorView x, MatrixId w, TensorView y) {
    ++counters_.launches;
    const WeightRef &m = matrix(w);
    op_checks::matmul("matmul", x, m.rows, m.cols, y);
    cpu::matmul(pool_, f32(x), x.rows(), m, f32(y), &act_scratch_);
}

void CpuBackend::matmul_canonical(TensorView x, MatrixId w, TensorView y, TensorView workspace) {
    ++counters_.launches;
    const WeightRef &m = matrix(w);
    op_checks::matmul("matmul_canonical", x, m.rows, m.cols, y);
    MEMRA_CHECK(workspace.numel() >= matmul_canonical_workspace_floats(x.rows(), m),
                "matmul_canonical: workspace of {} floats, {} needed", workspace.numel(),
                matmul_canonical_workspace_floats(x.rows(), m));
    cpu::matmul_canonical(pool_, f32(x), x.rows(), m, f32(y), f32(workspace), &act_scratch_);
}

void CpuBackend::matmul_grouped(TensorView x, BankId b, TensorView offsets, TensorView y) {
    ++counters_.launches;
    const WeightBankRef &bk = bank(b);
    const int32_t *off = grouped_offsets("matmul_grouped", x, bk, offsets, y);
    cpu::matmul_grouped(pool_, f32(x), bk, off + bk.first_expert, f32(y), &act_scratch_);
}

void CpuBackend::rope(RopeId table, TensorView x, int64_t n_heads, int64_t head_dim, TensorView positions) {
    ++counters_.launches;
    MEMRA_CHECK(table.id >= 0 && static_cast<size_t>(table.id) < rope_tables_.size(), "rope: unknown table {}",
                table.id);
    op_checks::rope(x, n_heads, head_dim, positions);
    auto r = rope_apply(pool_, rope_tables_[static_cast<size_t>(table.id)], f32(x), x.rows(), x.row_elems(), n_heads,
                        head_dim, i64(positions));
    MEMRA_CHECK(r.has_value(), "rope: {}", r ? "" : r.error().message);
}

void CpuBackend::paged_attention(const AttentionParams &p, TensorView q, TensorView q_pos, TensorView q_seq,
                                 KvPoolId pool, int layer, TensorView block_tables, int64_t first_pos, TensorView gate,
                                 TensorView out) {
    ++counters_.launches;
    const KvPool &kp = kv_pool(pool);
    const PagedLayer pl = paged_layer(kp, layer);  // checks the layer first
    const int64_t row = p.n_heads * p.head_dim;
    op_checks::paged_attention(p, q, q_pos, q_seq, layer, kp.layout.row_elems[static_cast<size_t>(layer)],
                               block_tables, gate, out);
    const bool gated = gate.data != nullptr;
    AttentionShape shape{p.n_heads, p.n_kv_heads, p.head_dim, p.window, attention_scale(p.head_dim)};
    shape.blocked = numerics_ == Numerics::kDevice;
    cpu::paged_attention(pool_, shape, f32(q), row, i64(q_pos), i32(q_seq), q.rows(), pl,
                         i32(block_tables), block_tables.row_elems(), block_tables.rows(), first_pos,
                         gated ? f32(gate) : nullptr, p.n_heads, f32(out));
}

void CpuBackend::kv_write(KvPoolId pool, int layer, TensorView k, TensorView v, TensorView slots) {
    ++counters_.launches;
    const KvPool &kp = kv_pool(pool);
    const PagedLayer pl = paged_layer(kp, layer);
    const int64_t row_elems = kp.layout.row_elems[static_cast<size_t>(layer)];
    op_checks::kv_write(k, v, slots, layer, row_elems);
    const int32_t *sl = i32(slots);
    const int64_t capacity = kp.spec.n_pages * kKvPageRows;
    for (int64_t i = 0; i < slots.numel(); ++i) {
        MEMRA_CHECK(sl[i] >= 0 && sl[i] < capacity, "kv_write: row {} slot {} outside the pool's {} slots", i, sl[i],
                    capacity);
    }
    cpu::kv_write(pool_, pl, row_elems, f32(k), f32(v), sl, k.rows());
}

void CpuBackend::round_rows(TensorView x, RowRounding r) {
    ++counters_.launches;
    cpu::round_rows(pool_, f32(x), x.rows(), x.row_elems(), r);
}

void CpuBackend::swiglu(TensorView gate, TensorView up, float limit, TensorView out) {
    ++counters_.launches;
    same_shape("swiglu", gate, up);
    same_shape("swiglu", gate, out);
    cpu::swiglu(pool_, f32(gate), f32(up), gate.row_elems(), gate.rows(), gate.row_elems(), limit, f32(out));
}

void CpuBackend::router_topk(const RouterConfig &cfg, TensorView logits, VectorId bias, TensorView expert_ids,
                             TensorView weights) {
    ++counters_.launches;
    const HostVector &b = host_vector(bias);
    op_checks::router_topk(cfg, logits, b.dtype, b.n, expert_ids, weights);
    const RouterParams params{cfg.n_experts, cfg.top_k, cfg.renormalize, cfg.scaling_factor};
    cpu::router_topk(pool_, params, f32(logits), static_cast<const float *>(b.data), logits.rows(), i32(expert_ids),
                     f32(weights));
}

void CpuBackend::moe_sort_pairs(TensorView expert_ids, int64_t n_experts, TensorView offsets, TensorView sorted_pair,
                                TensorView row_of_pair) {
    ++counters_.launches;
    op_checks::moe_sort_pairs(expert_ids, n_experts, offsets, sorted_pair, row_of_pair);
    cpu::moe_sort_pairs(i32(expert_ids), expert_ids.rows(), expert_ids.row_elems(), n_experts, i32(offsets),
                        i32(sorted_pair), i32(row_of_pair));
}

void CpuBackend::moe_permute(TensorView x, TensorView sorted_pair, TensorView offsets, int64_t expert_begin,
                             int64_t expert_end, int64_t top_k, TensorView x_own) {
    ++counters_.launches;
    const int32_t *off = i32(offsets);
    op_checks::moe_permute(x, sorted_pair, offsets, expert_begin, expert_end, top_k, x_own);
    const int64_t r0 = off[expert_begin];
    const int64_t r1 = off[expert_end];
    MEMRA_CHECK(0 <= r0 && r0 <= r1 && r1 <= sorted_pair.numel() && r1 - r0 <= x_own.rows(),
                "moe_permute: experts [{}, {}) own sorted rows [{}, {}), x_own holds {}", expert_begin, expert_end, r0,
                r1, x_own.rows());
    cpu::moe_permute(pool_, f32(x), x.row_elems(), i32(sorted_pair) + r0, r1 - r0, top_k, f32(x_own));
}

void CpuBackend::moe_source_rows(TensorView expert_ids, TensorView row_of_pair, TensorView offsets, int64_t n_owners,
                                 int64_t capacity, TensorView src_row) {
    ++counters_.launches;
    const int64_t n_experts = offsets.numel() - 1;
    op_checks::moe_source_rows(expert_ids, row_of_pair, offsets, n_owners, capacity, src_row);
    cpu::moe_source_rows(i32(expert_ids), i32(row_of_pair), expert_ids.numel(), i32(offsets), n_experts, n_owners,
                         capacity, i32(src_row));
}

void CpuBackend::moe_combine(TensorView h, TensorView expert_out, TensorView src_row, TensorView weights,
                             TensorView shared, TensorView out) {
    ++counters_.launches;
    op_checks::moe_combine(h, expert_out, src_row, weights, shared, out);
    const int64_t top_k = weights.row_elems();
    const int32_t *src = i32(src_row);
    for (int64_t q = 0; q < src_row.numel(); ++q) {
        MEMRA_CHECK(src[q] >= 0 && src[q] < expert_out.rows(), "moe_combine: pair {} reads row {} of {}", q, src[q],
                    expert_out.rows());
    }
    const bool has_shared = shared.data != nullptr;
    cpu::moe_combine(pool_, f32(h), f32(expert_out), src, f32(weights), has_shared ? f32(shared) : nullptr, h.rows(),
                     top_k, h.row_elems(), f32(out));
}

void CpuBackend::gather_rows(TensorView src, TensorView rows, TensorView dst) {
    ++counters_.launches;
    op_checks::gather_rows(src, rows, dst);
    const int32_t *idx = i32(rows);
    const size_t row_bytes = static_cast<size_t>(src.row_elems()) * dtype_size(src.dtype);
    for (int64_t i = 0; i < rows.numel(); ++i) {
        MEMRA_CHECK(idx[i] >= 0 && idx[i] < src.rows(), "gather_rows: row {} outside [0, {})", idx[i], src.rows());
        std::memcpy(static_cast<std::byte *>(dst.data) + static_cast<size_t>(i) * row_bytes,
                    static_cast<const std::byte *>(src.data) + static_cast<size_t>(idx[i]) * row_bytes, row_bytes);
    }
}

void CpuBackend::scatter_rows(TensorView src, TensorView rows, TensorView dst) {
    ++counters_.launches;
    op_checks::scatter_rows(src, rows, dst);
    const int32_t *idx = i32(rows);
    const size_t row_bytes = static_cast<size_t>(src.row_elems()) * dtype_size(src.dtype);
    for (int64_t i = 0; i < rows.numel(); ++i) {
        if (idx[i] < 0) continue;
        MEMRA_CHECK(idx[i] < dst.rows(), "scatter_rows: row {} outside [0, {})", idx[i], dst.rows());
        std::memcpy(static_cast<std::byte *>(dst.data) + static_cast<size_t>(idx[i]) * row_bytes,
                    static_cast<const std::byte *>(src.data) + static_cast<size_t>(i) * row_bytes, row_bytes);
    }
}

void CpuBackend::scatter_ids(TensorView tokens, TensorView pairs, TensorView dst) {
    ++counters_.launches;
    const int64_t n_tokens = op_checks::scatter_ids(tokens, pairs, dst);
    const auto *ts = static_cast<const SampledToken *>(tokens.data);
    const int32_t *pr = i32(pairs);
    int32_t *out = i32(dst);
    for (int64_t i = 0; i < pairs.numel() / 2; ++i) {
        MEMRA_CHECK(pr[2 * i] >= 0 && pr[2 * i] < n_tokens && pr[2 * i + 1] >= 0 && pr[2 * i + 1] < dst.numel(),
                    "scatter_ids: pair ({}, {}) outside {} tokens, {} ids", pr[2 * i], pr[2 * i + 1], n_tokens,
                    dst.numel());
        out[pr[2 * i + 1]] = ts[pr[2 * i]].id;
    }
}

void CpuBackend::concat_cols(TensorView a, TensorView b, TensorView out) {
    ++counters_.launches;
    op_checks::concat_cols(a, b, out);
    const int64_t da = a.row_elems();
    const int64_t db = b.row_elems();
    const float *pa = f32(a);
    const float *pb = f32(b);
    float *po = f32(out);
    for (int64_t t = 0; t < a.rows(); ++t) {
        std::memcpy(po + t * (da + db), pa + t * da, static_cast<size_t>(da) * sizeof(float));
        std::memcpy(po + t * (da + db) + da, pb + t * db, static_cast<size_t>(db) * sizeof(float));
    }
}

void CpuBackend::canonical_combine(TensorView subtree_sums, TensorView out) {
    ++counters_.launches;
    op_checks::canonical_combine(subtree_sums, out);
    canonical_tree_combine(f32(subtree_sums), subtree_sums.rows(), out.numel(), f32(out));
}

void CpuBackend::join_col_shards(TensorView shards, TensorView out) {
    ++counters_.launches;
    op_checks::join_col_shards(shards, out);
    const int64_t n_shards = shards.dim(0);
    const int64_t n = shards.dim(1);
    const int64_t w = shards.dim(2);
    const size_t elem = dtype_size(out.dtype);
    const size_t piece = static_cast<size_t>(w) * elem;
    const auto *src = static_cast<const std::byte *>(shards.data);
    auto *dst = static_cast<std::byte *>(out.data);
    for (int64_t s = 0; s < n_shards; ++s) {
        for (int64_t t = 0; t < n; ++t) {
            std::memcpy(dst + static_cast<size_t>(t * n_shards + s) * piece,
                        src + static_cast<size_t>(s * n + t) * piece, piece);
        }
    }
}

void CpuBackend::sample(TensorView logits, int32_t n_valid, TensorView rows, TensorView history, TensorView bias,
                        TensorView out) {
    ++counters_.launches;
    const int64_t n = op_checks::sample(logits, n_valid, rows, bias, out, sampler_ ? sampler_->vocab_size() : 0);
    const int64_t vocab = logits.row_elems();
    const auto *rs = static_cast<const SampleRow *>(rows.data);
    auto *os = static_cast<SampledToken *>(out.data);
    const int32_t *hist = i32(history);
    const auto *bs = static_cast<const LogitBias *>(bias.data);
    const auto n_bias = static_cast<int64_t>(bias.n_bytes() / sizeof(LogitBias));
    const float *lg = f32(logits);
    for (int64_t i = 0; i < n; ++i) {
        const SampleRow &r = rs[i];
        MEMRA_CHECK(r.logit_row >= 0 && r.logit_row < logits.rows() && r.history_begin >= 0 && r.history_len >= 0 &&
                        r.history_begin + r.history_len <= history.numel() && r.bias_begin >= 0 && r.bias_len >= 0 &&
                        r.bias_begin + r.bias_len <= n_bias,
                    "sample: row {} reads logits row {} of {}, history [{}, +{}) of {}, bias [{}, +{}) of {}", i,
                    r.logit_row, logits.rows(), r.history_begin, r.history_len, history.numel(), r.bias_begin,
                    r.bias_len, n_bias);
        const std::span<const float> row(lg + r.logit_row * vocab, static_cast<size_t>(n_valid));
        sampler_->set_params(r.params);
        SampledToken &o = os[i];
        const std::span<const LogitBias> row_bias =
            r.bias_len > 0 ? std::span<const LogitBias>(bs + r.bias_begin, static_cast<size_t>(r.bias_len))
                           : std::span<const LogitBias>();
        o.id = sampler_->sample(row, {hist + r.history_begin, static_cast<size_t>(r.history_len)}, r.choice,
                                r.position, row_bias);
        o.has_logprobs = r.top_logprobs >= 0 ? 1 : 0;
        if (r.top_logprobs >= 0) token_logprobs(row, o.id, r.top_logprobs, o.logprobs);
    }
}

}  // namespace memra::cpu
