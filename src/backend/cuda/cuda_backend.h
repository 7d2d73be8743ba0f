// CudaBackend: the Backend interface on one NVIDIA GPU, in `device` numerics (ENGINE.md section 4). Weights
// are uploaded once in their checkpoint dtypes (FP8 experts stay FP8 with their scales); activations, KV pools
// and workspaces are device allocations made at prepare time, so a step allocates nothing. Every op is one
// kernel launch on the backend's stream (ops_rows, ops_matmul, ops_attention, ops_route, ops_sample), each the
// device twin of the CPU kernel the interface names; nothing in an op reads device memory on the host. Host
// transfers are the only synchronisation: copy_to_host waits for the work before it.
//
// Several backends may share one GPU (tensor-parallel ranks as threads of one process): each has its own
// stream, created blocking, so a cudaMemcpy between ranks' buffers (cuda_rank_copy) orders after every rank's
// queued work.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/backend.h"
#include "backend/cpu/ops_attention.h"
#include "backend/cuda/ops_matmul.h"
#include "backend/cuda/ops_rows.h"
#include "backend/draft_forcing.h"
#include "core/kv_page.h"

namespace memra::cuda {

// What the GPU at `device_index` has: name, free and total bytes. An error when it cannot be queried.
struct GpuInfo {
    std::string name;
    int64_t free_bytes = 0;
    int64_t total_bytes = 0;
};
Result<GpuInfo> gpu_info(int device_index);

// Copies n bytes between any two buffers of this process, device or host, after all work queued on the
// current device's blocking streams (cudaMemcpy, cudaMemcpyDefault): how in-process ranks that share a GPU
// exchange their backend buffers (parallel::InProcessGroup's byte copy).
void cuda_rank_copy(void *dst, const void *src, size_t n);

class CudaBackend : public Backend {
public:
    // Refused: no such device, a non-device numerics mode, a failing stream creation. With `forcing` (which must
    // outlive the backend), speculation's drafts are replaced as cpu::ForcedDraftBackend replaces them.
    static Result<std::unique_ptr<CudaBackend>> create(int device_index, Numerics numerics,
                                                       const DraftForcing *forcing = nullptr);
    ~CudaBackend() override;
    CudaBackend(const CudaBackend &) = delete;
    CudaBackend &operator=(const CudaBackend &) = delete;

    const char *name() const override { return "cuda"; }
    Device device() const override { return Device::kCuda; }
    bool keeps_host_views() const override { return false; }  // uploads copy, then synchronize
    Numerics numerics() const override { return Numerics::kDevice; }
    int device_index() const { return device_; }
    // The stream every op of this backend is issued on (a communicator of its rank enqueues there too).
    cudaStream_t stream() const { return stream_; }
    // The stream the next op goes to: the side stream inside a side branch (side_begin .. side_end), else stream().
    cudaStream_t op_stream() const { return op_stream_; }
    void bind_thread() override { cudaSetDevice(device_); }
    // Device bytes this backend holds (weights, buffers, pools, workspaces).
    int64_t bytes_allocated() const { return bytes_; }
    // With MEMRA_CUDA_PROFILE=1 in the environment at creation, every op synchronises and its time (from the end of
    // the previous op or host copy to the end of its kernel: launch plus kernel, serialised) is added up per op
    // name; the Markdown table of those sums, also printed to stderr when the backend is destroyed.
    std::string op_time_table() const;
    // Called after each weight upload with its host bytes (the CLI's progress bar).
    void set_upload_observer(std::function<void(int64_t bytes)> observer) { upload_observer_ = std::move(observer); }

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
    void qk_norm_rope(TensorView q, int64_t n_heads, VectorId q_norm, TensorView k, int64_t n_kv_heads,
                      VectorId k_norm, int64_t head_dim, float eps, RopeId table, TensorView positions) override;
    void attention_prologue(const AttentionInputs &a) override;
    void add_rms_norm(TensorView x, TensorView r, VectorId w, float eps, TensorView h, TensorView y) override;
    void residual_add(TensorView a, TensorView b, TensorView out) override;
    void matmul(TensorView x, MatrixId w, TensorView y) override;
    void matmul_multi(TensorView x, std::span<const MatrixId> w, std::span<const TensorView> y) override;
    void matmul_canonical(TensorView x, MatrixId w, TensorView y, TensorView workspace) override;
    void matmul_grouped(TensorView x, BankId b, TensorView offsets, TensorView y) override;
    void matmul_grouped_pair(TensorView x, BankId a, BankId b, TensorView offsets, TensorView y_a,
                             TensorView y_b) override;
    void matmul_grouped_swiglu(TensorView gate, TensorView up, float limit, BankId b, TensorView offsets,
                               TensorView y) override;
    void canonical_combine(TensorView subtree_sums, TensorView out) override;
    void join_col_shards(TensorView shards, TensorView out) override;
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
    void moe_route(TensorView x, MatrixId router, const RouterConfig &cfg, VectorId bias,
                   const MoeRouteViews &r) override;
    void moe_combine(TensorView h, TensorView expert_out, TensorView src_row, TensorView weights,
                     TensorView shared, TensorView out) override;
    void gather_rows(TensorView src, TensorView rows, TensorView dst) override;
    void scatter_rows(TensorView src, TensorView rows, TensorView dst) override;
    void scatter_ids(TensorView tokens, TensorView pairs, TensorView dst) override;
    void concat_cols(TensorView a, TensorView b, TensorView out) override;
    void sample(TensorView logits, int32_t n_valid, TensorView rows, TensorView history, TensorView bias,
                TensorView out) override;

    // The side branch on a second stream, forked from and joined into the backend's stream by events (a captured
    // step records both streams). Off (every op on the one stream, these calls doing nothing) with
    // MEMRA_CUDA_SIDE=0 and with MEMRA_CUDA_PROFILE=1 (each op synchronises).
    void side_fork() override;
    void side_begin() override;
    void side_end() override;
    void side_join() override;

    // Steps recorded as CUDA graphs: a key seen for the second time is captured (its ops run as the graph's
    // first replay), later ones replay it; the least recently used of kMaxStepGraphs is dropped for a new one.
    // Off with MEMRA_CUDA_GRAPHS=0, with MEMRA_CUDA_PROFILE=1 (each op synchronises) and with draft forcing
    // (host state per step).
    Result<void> run_recorded(std::span<const int64_t> key, FunctionRef<Result<void>()> body) override;
    // Graph replays and captures so far.
    int64_t graph_replays() const { return graph_replays_; }
    int64_t graph_captures() const { return graph_captures_; }

    // A device-to-device cudaMemcpyAsync on the backend's stream, timed with events.
    Result<double> copy_bandwidth(int64_t bytes) override;
    BackendCounters counters() const override { return counters_; }
    void reset_counters() override { counters_ = {}; }

private:
    CudaBackend(int device_index, cudaStream_t stream, const DraftForcing *forcing);

    struct Vector {
        DType dtype = DType::kF32;
        const void *data = nullptr;  // device
        int64_t n = 0;
    };
    struct Rope {  // a device copy of the host's cpu::RopeTable
        const float *cos = nullptr;  // [n_positions, half]
        const float *sin = nullptr;
        int64_t half = 0;
        int64_t n_positions = 0;
    };
    struct KvPool {
        KvPoolSpec spec;
        KvPageLayout layout;
        TensorView storage;  // [pool bytes] kU8
    };

    // Rows the sampling op runs at once, one block each (more rows take turns): its workspace holds this many.
    static constexpr int64_t kSampleSlots = 64;

    // A zero-filled device allocation of `bytes` bytes, freed with the backend; `what` names it in the error.
    Result<void *> device_alloc(size_t bytes, const std::string &what);
    // Checks a launch's status and counts it; a failure is a programming error or a lost device (aborts with
    // the op's name and CUDA's message).
    void launched(const char *op, int status);
    const CudaMatrix &matrix(MatrixId id) const;
    const CudaBank &bank(BankId id) const;
    const Vector &vector(VectorId id) const;
    const KvPool &kv_pool(KvPoolId id) const;
    cpu::PagedLayer paged_layer(const KvPool &pool, int layer) const;
    // kv_write's checks of its rows against the pool's layer, which it returns.
    cpu::PagedLayer kv_rows(const KvPool &kp, int layer, TensorView k, TensorView v, TensorView slots) const;
    // qk_norm_rope's checks (`op` names the caller) and its launch arguments: q's and k's heads, the table's rows.
    struct QkArgs {
        cuda::QkHeads q, k;
        cuda::RopeRows rope;
    };
    QkArgs qk_args(const char *op, TensorView q, int64_t n_heads, VectorId q_norm, TensorView k, int64_t n_kv_heads,
                   VectorId k_norm, int64_t head_dim, RopeId table, TensorView positions) const;

    int device_;
    cudaStream_t stream_;
    // The side branch (side_fork .. side_join): its stream and events, created with the backend; op_stream_ is
    // the stream the next op goes to (side_ between side_begin and side_end, else stream_).
    bool side_on_ = true;
    cudaStream_t side_ = nullptr;
    cudaEvent_t fork_event_ = nullptr;
    cudaEvent_t join_event_ = nullptr;
    cudaStream_t op_stream_;
    bool forked_ = false;     // a fork is marked
    bool side_open_ = false;  // between side_begin and side_end
    bool side_ran_ = false;   // the branch has ops the stream must wait for at the join
    // Joins the side's work so far into the stream, an open branch staying open: side_join, and before a host
    // copy, a bandwidth probe, a recorded step and the end of its capture.
    void settle_side();
    int64_t bytes_ = 0;
    std::vector<void *> allocations_;
    std::vector<CudaMatrix> matrices_;
    std::vector<CudaBank> banks_;
    std::vector<Vector> vectors_;
    std::vector<Rope> ropes_;
    std::vector<KvPool> kv_pools_;
    // A device i32 the kernels raise on an index outside its range (a broken invariant: the engine checks its
    // inputs at plan time); read at every copy_to_host, which synchronises anyway.
    int32_t *error_flag_ = nullptr;
    int32_t *route_tickets_ = nullptr;  // cuda::moe_route's tickets: zero between launches
    // Split-KV attention's states (cuda::paged_attention): 64 MiB hold every split of batch 128 at 4K positions, or
    // of one sequence up to ~1M; a larger step runs each work item's splits in one CTA (the same bits).
    static constexpr int64_t kAttentionSplitFloats = int64_t{16} << 20;
    float *attention_split_ = nullptr;
    // The tensor-core e4m3 products' quantized activations (cuda::E4m3Scratch), allocated with the first bank
    // that needs it.
    E4m3Scratch e4m3_scratch_;
    void *sample_workspace_ = nullptr;
    int64_t sample_workspace_bytes_ = 0;
    int32_t sample_vocab_ = 0;
    void profile_mark();

    struct OpTime {
        int64_t calls = 0;
        double seconds = 0.0;
        int64_t weight_bytes = 0;  // products: the weight bytes the calls read
    };
    // launched() for a product over m with `tokens` rows: profiled per op and shape, with m's bytes.
    void launched_product(const char *op, int status, const CudaMatrix &m, int64_t tokens);
    bool profile_ = false;
    std::chrono::steady_clock::time_point profile_mark_;
    std::map<std::string, OpTime> op_times_;
    const DraftForcing *forcing_;
    uint64_t forcing_seen_ = ~uint64_t{0};  // the forcing step last seen, and the draft stage within it
    int forcing_stage_ = 0;
    std::function<void(int64_t)> upload_observer_;
    BackendCounters counters_;

    // Recorded steps, in storage made at creation (recording a step allocates nothing on the host heap).
    static constexpr size_t kMaxStepKey = 512;
    static constexpr size_t kMaxStepGraphs = 16;
    static constexpr size_t kSeenKeys = 64;  // hashes of keys seen once, a ring
    struct StepGraph {
        cudaGraphExec_t exec = nullptr;  // null: the slot is free
        size_t key_len = 0;
        int64_t key[kMaxStepKey] = {};
        BackendCounters counts;  // what the recorded body added to the counters
        uint64_t last_use = 0;
    };
    bool graphs_ = true;
    bool capturing_ = false;
    std::unique_ptr<StepGraph[]> step_graphs_;
    uint64_t seen_[kSeenKeys] = {};
    size_t seen_next_ = 0;
    uint64_t graph_clock_ = 0;
    int64_t graph_replays_ = 0;
    int64_t graph_captures_ = 0;
};

}  // namespace memra::cuda
