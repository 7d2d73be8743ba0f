// CpuBackend: the Backend interface over the CPU reference kernels (backend/cpu/ops*.h, matmul.h) and one
// owned ThreadPool. Weights are zero-copy views into host memory (the checkpoint's mmap); buffers are host
// allocations made at prepare time; a TP rank's shard is a window view of the same memory (row stride,
// absolute K origin), never a copy. On a CPU with AVX512-BF16 the weights of device products also get a copy in
// 16-row panels (matmul.h WeightPanels), the layout that path reads fastest: their memory twice over.
// Every op call counts one launch, every host transfer one host copy.
// Not final: a test may derive from it to perturb one op and show a bit gate can fail.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops_attention.h"
#include "backend/cpu/ops_rope.h"
#include "core/thread_pool.h"

namespace memra::cpu {

class CpuBackend : public Backend {
public:
    // n_threads >= 1 (MEMRA_CHECK): the pool size; results do not depend on it (D5). numerics: what the
    // products and attention compute (device: bf16 / e4m3 activations at ENGINE.md section 4's points, the
    // blocked attention order; exact: f32 activations, the two-pass attention).
    CpuBackend(int n_threads, Numerics numerics);
    ~CpuBackend() override;
    CpuBackend(const CpuBackend &) = delete;
    CpuBackend &operator=(const CpuBackend &) = delete;

    const char *name() const override { return "cpu"; }
    Device device() const override { return Device::kCpu; }
    Numerics numerics() const override { return numerics_; }
    int n_threads() const { return pool_.n_threads(); }

    Result<TensorView> alloc(DType dtype, std::initializer_list<int64_t> shape) override;
    Result<MatrixId> upload_matrix(const HostMatrix &m) override;
    Result<BankId> upload_bank(const HostBank &b) override;
    Result<MatrixId> upload_matrix_window(const HostMatrix &m, const MatrixWindow &w) override;
    Result<BankId> upload_bank_window(const HostBank &b, const BankWindow &w) override;
    Result<VectorId> upload_vector(const HostVector &v) override;
    Result<RopeId> create_rope_table(int64_t rot_dim, double theta, const RopeScalingParams *llama3,
                                     int64_t n_positions) override;
    int64_t canonical_workspace_floats(int64_t n_rows, MatrixId w) const override;
    Result<KvPoolId> create_kv_pool(const KvPoolSpec &spec) override;
    TensorView kv_pool_storage(KvPoolId pool) const override;
    Result<void> prepare_sampling(int32_t vocab_size) override;

    void copy_from_host(const void *src, TensorView dst) override;
    void copy_to_host(TensorView src, void *dst) override;

    Result<void> embedding(MatrixId table, TensorView ids, TensorView out) override;
    void rms_norm(TensorView x, VectorId w, float eps, TensorView y) override;
    void rms_norm_heads(TensorView x, int64_t n_heads, int64_t head_dim, VectorId w, float eps) override;
    void add_rms_norm(TensorView x, TensorView r, VectorId w, float eps, TensorView h, TensorView y) override;
    void residual_add(TensorView a, TensorView b, TensorView out) override;
    void matmul(TensorView x, MatrixId w, TensorView y) override;
    void matmul_canonical(TensorView x, MatrixId w, TensorView y, TensorView workspace) override;
    void matmul_grouped(TensorView x, BankId b, TensorView offsets, TensorView y) override;
    void rope(RopeId table, TensorView x, int64_t n_heads, int64_t head_dim, TensorView positions) override;
    void paged_attention(const AttentionParams &p, TensorView q, TensorView q_pos, TensorView q_seq, KvPoolId pool,
                         int layer, TensorView block_tables, int64_t first_pos, TensorView gate,
                         TensorView out) override;
    void kv_write(KvPoolId pool, int layer, TensorView k, TensorView v, TensorView slots) override;
    void round_rows(TensorView x, RowRounding r) override;
    void swiglu(TensorView gate, TensorView up, float limit, TensorView out) override;
    void router_topk(const RouterConfig &cfg, TensorView logits, VectorId bias, TensorView expert_ids,
                     TensorView weights) override;
    void moe_sort_pairs(TensorView expert_ids, int64_t n_experts, TensorView offsets, TensorView sorted_pair,
                        TensorView row_of_pair) override;
    void moe_permute(TensorView x, TensorView sorted_pair, TensorView offsets, int64_t expert_begin,
                     int64_t expert_end, int64_t top_k, TensorView x_own) override;
    void moe_source_rows(TensorView expert_ids, TensorView row_of_pair, TensorView offsets, int64_t n_owners,
                         int64_t capacity, TensorView src_row) override;
    void moe_combine(TensorView h, TensorView expert_out, TensorView src_row, TensorView weights,
                     TensorView shared, TensorView out) override;
    void gather_rows(TensorView src, TensorView rows, TensorView dst) override;
    void scatter_rows(TensorView src, TensorView rows, TensorView dst) override;
    void scatter_ids(TensorView tokens, TensorView pairs, TensorView dst) override;
    void concat_cols(TensorView a, TensorView b, TensorView out) override;
    void canonical_combine(TensorView subtree_sums, TensorView out) override;
    void join_col_shards(TensorView shards, TensorView out) override;
    void sample(TensorView logits, int32_t n_valid, TensorView rows, TensorView history, TensorView bias,
                TensorView out) override;

    // A copy split over the backend's threads in ranges of 1 MiB or more.
    Result<double> copy_bandwidth(int64_t bytes) override;
    BackendCounters counters() const override { return counters_; }
    void reset_counters() override { counters_ = {}; }

protected:
    // Counts one launch, for an op a derived test backend replaces.
    void count_launch() { ++counters_.launches; }

private:
    const WeightRef &matrix(MatrixId id) const;
    // 64-byte aligned storage for `bytes` of weight panels, owned by the backend; nullptr when bytes is 0 or
    // no product path here reads panels.
    Result<void *> panel_storage(int64_t bytes);
    const WeightBankRef &bank(BankId id) const;
    const HostVector &host_vector(VectorId id) const;
    struct KvPool {
        KvPoolSpec spec;
        KvPageLayout layout;
        TensorView storage;  // [pool bytes] kU8, one of buffers_
    };
    const KvPool &kv_pool(KvPoolId id) const;
    PagedLayer paged_layer(const KvPool &pool, int layer) const;

    ThreadPool pool_;
    Numerics numerics_;
    // Device numerics: the rounded activations of one product, sized by the largest f32 buffer (alloc).
    std::vector<uint16_t> act_codes_;
    std::vector<float> act_scales_;
    ActScratch act_scratch_;
    std::vector<std::unique_ptr<std::byte[]>> buffers_;  // every alloc(), freed with the backend
    std::vector<WeightRef> matrices_;                    // views into host memory the caller keeps alive
    std::vector<WeightBankRef> banks_;
    std::vector<HostVector> vectors_;
    std::vector<RopeTable> rope_tables_;
    std::vector<KvPool> kv_pools_;
    std::optional<Sampler> sampler_;  // the sampling op's workspace (prepare_sampling)
    BackendCounters counters_;
};

}  // namespace memra::cpu
