// CudaBackend (cuda_backend.h): memory, uploads, transfers and counters; the ops call the launchers of
// ops_rows, ops_matmul, ops_attention, ops_route and ops_sample.
#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "backend/cpu/ops_rope.h"
#include "backend/cuda/ops_attention.h"
#include "backend/cuda/ops_forcing.h"
#include "backend/cuda/ops_route.h"
#include "backend/cuda/ops_rows.h"
#include "backend/cuda/ops_sample.h"
#include "backend/op_checks.h"
#include "core/check.h"
#include "core/kv_format.h"
#include "core/quant_blocks.h"
#include "core/thread_pool.h"

namespace memra::cuda {

namespace {

std::string cuda_message(cudaError_t e) { return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e)); }

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

Result<GpuInfo> gpu_info(int device_index) {
    cudaDeviceProp prop{};
    if (cudaError_t e = cudaGetDeviceProperties(&prop, device_index); e != cudaSuccess) {
        return make_error("cuda: GPU {}: {}", device_index, cuda_message(e));
    }
    if (cudaError_t e = cudaSetDevice(device_index); e != cudaSuccess) {
        return make_error("cuda: GPU {}: {}", device_index, cuda_message(e));
    }
    size_t free_b = 0;
    size_t total_b = 0;
    if (cudaError_t e = cudaMemGetInfo(&free_b, &total_b); e != cudaSuccess) {
        return make_error("cuda: GPU {} memory: {}", device_index, cuda_message(e));
    }
    return GpuInfo{prop.name, static_cast<int64_t>(free_b), static_cast<int64_t>(total_b)};
}

void cuda_rank_copy(void *dst, const void *src, size_t n) {
    const cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyDefault);
    MEMRA_CHECK(e == cudaSuccess, "cuda rank copy of {} bytes: {}", n, cuda_message(e));
}

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(int device_index, Numerics numerics,
                                                         const DraftForcing *forcing) {
    if (numerics != Numerics::kDevice) {
        return make_error("cuda backend: computes device numerics only (asked for {})", numerics_name(numerics));
    }
    int n = 0;
    if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
        return make_error("cuda backend: no CUDA device ({})", e == cudaSuccess ? "none visible" : cuda_message(e));
    }
    if (device_index < 0 || device_index >= n) {
        return make_error("cuda backend: GPU {} does not exist ({} visible)", device_index, n);
    }
    if (cudaError_t e = cudaSetDevice(device_index); e != cudaSuccess) {
        return make_error("cuda backend: GPU {}: {}", device_index, cuda_message(e));
    }
    bool attention = false;
    if (cudaError_t e = cuda::attention_supported(attention); e != cudaSuccess || !attention) {
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_index);
        return make_error("cuda backend: GPU {} has compute capability {}.{}; this build's attention kernel needs 9.0 "
                          "(Hopper: thread-block clusters, sm_90a code){}",
                          device_index, major, minor, e == cudaSuccess ? "" : fmt::format(" ({})", cuda_message(e)));
    }
    cudaStream_t stream = nullptr;
    // Blocking (cudaStreamDefault): cudaMemcpy on the legacy stream (cuda_rank_copy) orders after it.
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamDefault); e != cudaSuccess) {
        return make_error("cuda backend: stream: {}", cuda_message(e));
    }
    std::unique_ptr<CudaBackend> be(new CudaBackend(device_index, stream, forcing));
    if (be->side_on_) {
        cudaError_t e = cudaStreamCreateWithFlags(&be->side_, cudaStreamDefault);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&be->fork_event_, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&be->join_event_, cudaEventDisableTiming);
        if (e != cudaSuccess) return make_error("cuda backend: the side stream: {}", cuda_message(e));
    }
    auto flag = be->device_alloc(sizeof(int32_t), "the kernels' error flag");
    if (!flag) return tl::unexpected(flag.error());
    be->error_flag_ = static_cast<int32_t *>(*flag);
    auto tickets = be->device_alloc(cuda::kRouteTickets * sizeof(int32_t), "the routing's tickets");
    if (!tickets) return tl::unexpected(tickets.error());
    be->route_tickets_ = static_cast<int32_t *>(*tickets);
    auto split = be->device_alloc(kAttentionSplitFloats * sizeof(float), "the attention split workspace");
    if (!split) return tl::unexpected(split.error());
    be->attention_split_ = static_cast<float *>(*split);
    return be;
}

CudaBackend::CudaBackend(int device_index, cudaStream_t stream, const DraftForcing *forcing)
    : device_(device_index), stream_(stream), op_stream_(stream), forcing_(forcing) {
    const char *profile = std::getenv("MEMRA_CUDA_PROFILE");
    profile_ = profile != nullptr && std::strcmp(profile, "1") == 0;
    const char *side = std::getenv("MEMRA_CUDA_SIDE");
    side_on_ = !profile_ && !(side != nullptr && std::strcmp(side, "0") == 0);
    profile_mark_ = std::chrono::steady_clock::now();
    const char *graphs = std::getenv("MEMRA_CUDA_GRAPHS");
    graphs_ = !profile_ && forcing_ == nullptr && !(graphs != nullptr && std::strcmp(graphs, "0") == 0);
    if (graphs_) step_graphs_ = std::make_unique<StepGraph[]>(kMaxStepGraphs);
}

CudaBackend::~CudaBackend() {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    if (side_ != nullptr) cudaStreamSynchronize(side_);
    if (profile_ && !op_times_.empty()) {
        std::fprintf(stderr, "cuda op times (MEMRA_CUDA_PROFILE; GPU %d, this backend's life):\n%s", device_,
                     op_time_table().c_str());
    }
    for (size_t i = 0; step_graphs_ && i < kMaxStepGraphs; ++i) {
        if (step_graphs_[i].exec != nullptr) cudaGraphExecDestroy(step_graphs_[i].exec);
    }
    for (void *p : allocations_) cudaFree(p);
    if (fork_event_ != nullptr) cudaEventDestroy(fork_event_);
    if (join_event_ != nullptr) cudaEventDestroy(join_event_);
    if (side_ != nullptr) cudaStreamDestroy(side_);
    cudaStreamDestroy(stream_);
}

namespace {

uint64_t hash_key(std::span<const int64_t> key) {  // FNV-1a over the values' bytes
    uint64_t h = 1469598103934665603ull;
    for (const int64_t v : key) {
        for (int b = 0; b < 8; ++b) {
            h ^= (static_cast<uint64_t>(v) >> (8 * b)) & 0xffu;
            h *= 1099511628211ull;
        }
    }
    return h;
}

void add_counts(BackendCounters &to, const BackendCounters &d) {
    to.launches += d.launches;
    to.h2d_copies += d.h2d_copies;
    to.d2h_copies += d.d2h_copies;
    to.copy_bytes += d.copy_bytes;
}

}  // namespace

Result<void> CudaBackend::run_recorded(std::span<const int64_t> key, FunctionRef<Result<void>()> body) {
    if (!graphs_ || key.size() > kMaxStepKey) return body();
    cudaSetDevice(device_);
    // A branch issued before the step joins first: a replay or a capture on the stream must order after it (a
    // capture cannot wait on an event recorded outside it).
    MEMRA_CHECK(!side_open_, "cuda: a recorded step begun inside a side branch (side_end first)");
    settle_side();
    StepGraph *lru = &step_graphs_[0];
    for (size_t i = 0; i < kMaxStepGraphs; ++i) {
        StepGraph &g = step_graphs_[i];
        if (g.exec != nullptr && g.key_len == key.size() &&
            std::equal(key.begin(), key.end(), static_cast<const int64_t *>(g.key))) {
            const cudaError_t e = cudaGraphLaunch(g.exec, stream_);
            MEMRA_CHECK(e == cudaSuccess, "cuda: replaying a recorded step: {}", cuda_message(e));
            add_counts(counters_, g.counts);
            g.last_use = ++graph_clock_;
            ++graph_replays_;
            return {};
        }
        if (lru->exec != nullptr && (g.exec == nullptr || g.last_use < lru->last_use)) lru = &g;
    }
    // A key seen once runs as it is (a one-off shape, such as a prompt's, is not worth a capture).
    const uint64_t h = hash_key(key);
    if (std::find(std::begin(seen_), std::end(seen_), h) == std::end(seen_)) {
        seen_[seen_next_++ % kSeenKeys] = h;
        return body();
    }
    if (lru->exec != nullptr) {  // evicted: wait for a replay of it that may still run (an abandoned step's)
        const cudaError_t e = cudaStreamSynchronize(stream_);
        MEMRA_CHECK(e == cudaSuccess, "cuda: evicting a step graph: {}", cuda_message(e));
        cudaGraphExecDestroy(lru->exec);
        lru->exec = nullptr;
    }
    const BackendCounters before = counters_;
    cudaError_t e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
    MEMRA_CHECK(e == cudaSuccess, "cuda: starting a step capture: {}", cuda_message(e));
    capturing_ = true;
    forked_ = false;  // a fork marked outside the capture cannot order the captured work
    Result<void> ok = body();
    if (side_open_) side_end();  // (a body that failed inside a branch)
    settle_side();               // the side stream's captured work joins the capture's origin before it ends
    forked_ = false;             // nor can one marked inside it order later work
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    e = cudaStreamEndCapture(stream_, &graph);
    if (!ok) {  // nothing ran: the captured work is dropped with the step
        if (graph != nullptr) cudaGraphDestroy(graph);
        return ok;
    }
    MEMRA_CHECK(e == cudaSuccess && graph != nullptr, "cuda: capturing a step: {}", cuda_message(e));
    e = cudaGraphInstantiate(&lru->exec, graph, 0);
    cudaGraphDestroy(graph);
    MEMRA_CHECK(e == cudaSuccess, "cuda: instantiating a step graph: {}", cuda_message(e));
    std::copy(key.begin(), key.end(), static_cast<int64_t *>(lru->key));
    lru->key_len = key.size();
    lru->counts = {counters_.launches - before.launches, counters_.h2d_copies - before.h2d_copies,
                   counters_.d2h_copies - before.d2h_copies, counters_.copy_bytes - before.copy_bytes};
    lru->last_use = ++graph_clock_;
    ++graph_captures_;
    e = cudaGraphLaunch(lru->exec, stream_);
    MEMRA_CHECK(e == cudaSuccess, "cuda: launching a step graph: {}", cuda_message(e));
    return {};
}

Result<void *> CudaBackend::device_alloc(size_t bytes, const std::string &what) {
    cudaSetDevice(device_);
    void *p = nullptr;
    const size_t n = std::max<size_t>(bytes, 1);  // distinct non-null pointers for empty views
    if (cudaError_t e = cudaMalloc(&p, n); e != cudaSuccess) {
        cudaGetLastError();  // an allocation failure is not sticky: clear it so no later call reports it
        size_t free_b = 0;
        size_t total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        return make_error("cuda: out of device memory for {}: needs {:.1f} MiB, {:.1f} MiB free of {:.1f} MiB ({} "
                          "held by this backend; {})",
                          what, mib(static_cast<int64_t>(n)), mib(static_cast<int64_t>(free_b)),
                          mib(static_cast<int64_t>(total_b)), fmt::format("{:.1f} MiB", mib(bytes_)), cuda_message(e));
    }
    if (cudaError_t e = cudaMemsetAsync(p, 0, n, stream_); e != cudaSuccess) {
        cudaFree(p);
        return make_error("cuda: zeroing {}: {}", what, cuda_message(e));
    }
    allocations_.push_back(p);
    bytes_ += static_cast<int64_t>(n);
    return p;
}

Result<double> CudaBackend::copy_bandwidth(int64_t bytes) {
    MEMRA_CHECK(!capturing_, "cuda: copy_bandwidth inside a recorded step");
    settle_side();
    if (bytes < 1) return make_error("cuda copy bandwidth: {} bytes, expected >= 1", bytes);
    cudaSetDevice(device_);
    const auto n = static_cast<size_t>(bytes);
    void *src = nullptr;
    void *dst = nullptr;
    cudaEvent_t a = nullptr;
    cudaEvent_t b = nullptr;
    cudaError_t e = cudaMalloc(&src, n);
    if (e == cudaSuccess) e = cudaMalloc(&dst, n);
    if (e == cudaSuccess) e = cudaMemsetAsync(src, 0x3c, n, stream_);  // every page touched, no NaN pattern
    if (e == cudaSuccess) e = cudaEventCreate(&a);
    if (e == cudaSuccess) e = cudaEventCreate(&b);
    double best = 0.0;
    for (int rep = 0; rep < 4 && e == cudaSuccess; ++rep) {  // rep 0: the warm-up
        e = cudaEventRecord(a, stream_);
        if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream_);
        if (e == cudaSuccess) e = cudaEventRecord(b, stream_);
        if (e == cudaSuccess) e = cudaEventSynchronize(b);
        float ms = 0.0f;
        if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, a, b);
        if (e == cudaSuccess && rep > 0 && ms > 0.0f) {
            best = std::max(best, 2.0 * static_cast<double>(bytes) / (1e-3 * ms));
        }
    }
    cudaStreamSynchronize(stream_);
    if (a != nullptr) cudaEventDestroy(a);
    if (b != nullptr) cudaEventDestroy(b);
    cudaFree(src);  // null: a no-op
    cudaFree(dst);
    if (e != cudaSuccess) {
        cudaGetLastError();  // an allocation failure is not sticky
        return make_error("cuda copy bandwidth of 2 x {} bytes: {}", bytes, cuda_message(e));
    }
    return best;
}

void CudaBackend::side_fork() {
    if (!side_on_) return;
    MEMRA_CHECK(!side_open_, "cuda side_fork: inside a side branch (side_end first)");
    side_join();  // one branch at a time
    const cudaError_t e = cudaEventRecord(fork_event_, stream_);
    MEMRA_CHECK(e == cudaSuccess, "cuda side_fork: {}", cuda_message(e));
    forked_ = true;
}

void CudaBackend::side_begin() {
    if (!side_on_) return;
    MEMRA_CHECK(forked_ && !side_open_, "cuda side_begin: {}", side_open_ ? "the branch is open" : "no fork marked");
    const cudaError_t e = cudaStreamWaitEvent(side_, fork_event_, 0);
    MEMRA_CHECK(e == cudaSuccess, "cuda side_begin: {}", cuda_message(e));
    op_stream_ = side_;
    side_open_ = true;
}

void CudaBackend::side_end() {
    if (!side_on_) return;
    MEMRA_CHECK(side_open_, "cuda side_end: no side branch is open");
    op_stream_ = stream_;
    side_open_ = false;
    side_ran_ = true;
}

void CudaBackend::side_join() {
    if (!side_on_) return;
    MEMRA_CHECK(!side_open_, "cuda side_join: the branch is open (side_end first)");
    settle_side();  // the fork stays marked: a later side_begin still starts after it
}

void CudaBackend::settle_side() {
    if (!side_on_ || !(side_open_ || side_ran_)) return;
    // The side's work so far, joined (the event recorded on the side stream now); an open branch stays open (its
    // later ops join at its end).
    cudaError_t e = cudaEventRecord(join_event_, side_);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, join_event_, 0);
    MEMRA_CHECK(e == cudaSuccess, "cuda: joining the side branch: {}", cuda_message(e));
    side_ran_ = false;
}

void CudaBackend::launched(const char *op, int status) {
    ++counters_.launches;
    const auto e = static_cast<cudaError_t>(status);
    MEMRA_CHECK(e == cudaSuccess, "cuda {}: {}", op, cuda_message(e));
    if (profile_) {
        // Serialised: the op's time is from the end of the previous synchronisation to the end of its kernel.
        const cudaError_t sync = cudaStreamSynchronize(stream_);
        MEMRA_CHECK(sync == cudaSuccess, "cuda {}: {}", op, cuda_message(sync));
        const auto now = std::chrono::steady_clock::now();
        OpTime &t = op_times_[op];
        ++t.calls;
        t.seconds += std::chrono::duration<double>(now - profile_mark_).count();
        profile_mark_ = now;
    }
}

void CudaBackend::launched_product(const char *op, int status, const CudaMatrix &m, int64_t tokens) {
    if (!profile_) {
        launched(op, status);
        return;
    }
    // One row per op, shape and token count (the key is built only when profiling).
    const std::string key = fmt::format("{} {} [{}, {}] x{}", op, dtype_name(m.dtype), m.rows, m.cols, tokens);
    launched(key.c_str(), status);
    op_times_[key].weight_bytes += m.rows * m.cols * static_cast<int64_t>(dtype_size(m.dtype));
}

void CudaBackend::profile_mark() {
    if (profile_) profile_mark_ = std::chrono::steady_clock::now();
}

std::string CudaBackend::op_time_table() const {
    std::vector<std::pair<std::string, OpTime>> rows(op_times_.begin(), op_times_.end());
    std::sort(rows.begin(), rows.end(), [](const auto &a, const auto &b) { return a.second.seconds > b.second.seconds; });
    double total = 0.0;
    for (const auto &r : rows) total += r.second.seconds;
    std::string out = fmt::format(
        "| op | calls | total ms | mean us | share | weight GB/s |\n| --- | ---: | ---: | ---: | ---: | ---: |\n");
    for (const auto &[name, t] : rows) {
        const std::string rate =
            t.weight_bytes > 0 && t.seconds > 0.0 ? fmt::format("{:.0f}", 1e-9 * static_cast<double>(t.weight_bytes) / t.seconds) : "";
        out += fmt::format("| {} | {} | {:.2f} | {:.1f} | {:.1f} % | {} |\n", name, t.calls, t.seconds * 1e3,
                           t.seconds * 1e6 / static_cast<double>(std::max<int64_t>(t.calls, 1)),
                           total > 0.0 ? 100.0 * t.seconds / total : 0.0, rate);
    }
    return out;
}

Result<TensorView> CudaBackend::alloc(DType dtype, std::initializer_list<int64_t> shape) {
    if (shape.size() < 1 || shape.size() > kTensorMaxRank) {
        return make_error("cuda alloc: rank {} outside [1, {}]", shape.size(), kTensorMaxRank);
    }
    TensorView v;
    v.dtype = dtype;
    v.device = Device::kCuda;
    v.device_index = device_;
    v.rank = static_cast<int>(shape.size());
    size_t i = 0;
    for (int64_t d : shape) {
        if (d < 0) return make_error("cuda alloc: dimension {} is negative ({})", i, d);
        v.shape[i++] = d;
    }
    auto p = device_alloc(v.n_bytes(), fmt::format("a [{}] {} buffer", v.numel(), dtype_name(dtype)));
    if (!p) return tl::unexpected(p.error());
    v.data = *p;
    return v;
}

Result<MatrixId> CudaBackend::upload_matrix(const HostMatrix &m) {
    return upload_matrix_window(m, MatrixWindow::whole(m));
}

Result<BankId> CudaBackend::upload_bank(const HostBank &b) { return upload_bank_window(b, BankWindow::whole(b)); }

Result<MatrixId> CudaBackend::upload_matrix_window(const HostMatrix &m, const MatrixWindow &w) {
    if (auto ok = check_cuda_matrix(m, w); !ok) return tl::unexpected(ok.error());
    const int64_t bytes = cuda_matrix_bytes(m, w);
    auto dst = device_alloc(static_cast<size_t>(bytes),
                            fmt::format("a [{}, {}] {} matrix", m.rows, m.cols, dtype_name(m.dtype)));
    if (!dst) return tl::unexpected(dst.error());
    auto up = upload_cuda_matrix(m, w, *dst, stream_);
    if (!up) return tl::unexpected(up.error());
    matrices_.push_back(*up);
    if (upload_observer_) upload_observer_(bytes);
    return MatrixId{static_cast<int32_t>(matrices_.size() - 1)};
}

Result<BankId> CudaBackend::upload_bank_window(const HostBank &b, const BankWindow &w) {
    if (auto ok = check_cuda_bank(b, w); !ok) return tl::unexpected(ok.error());
    const int64_t bytes = cuda_bank_bytes(b, w);
    auto dst = device_alloc(static_cast<size_t>(bytes),
                            fmt::format("a bank of {} [{}, {}] {} experts", w.expert_end - w.expert_begin, b.rows,
                                        b.cols, dtype_name(b.dtype)));
    if (!dst) return tl::unexpected(dst.error());
    auto up = upload_cuda_bank(b, w, *dst, stream_);
    if (!up) return tl::unexpected(up.error());
    if (up->act == ActRounding::kE4m3x128 && e4m3_scratch_.codes == nullptr) {  // the first such bank
        auto codes = device_alloc(static_cast<size_t>(kE4m3ScratchCodeBytes), "the e4m3 activation codes");
        if (!codes) return tl::unexpected(codes.error());
        auto scales =
            device_alloc(static_cast<size_t>(kE4m3ScratchScaleFloats) * sizeof(float), "the e4m3 activation scales");
        if (!scales) return tl::unexpected(scales.error());
        e4m3_scratch_ = {static_cast<uint8_t *>(*codes), static_cast<float *>(*scales), kE4m3ScratchCodeBytes,
                         kE4m3ScratchScaleFloats};
    }
    banks_.push_back(*up);
    if (upload_observer_) upload_observer_(bytes);
    return BankId{static_cast<int32_t>(banks_.size() - 1)};
}

Result<VectorId> CudaBackend::upload_vector(const HostVector &v) {
    if (v.dtype != DType::kF32 && v.dtype != DType::kBF16) {
        return make_error("cuda upload: vector dtype {} is not supported (F32 or BF16)", dtype_name(v.dtype));
    }
    if (v.n <= 0 || v.data == nullptr) return make_error("cuda upload: vector [{}] must be non-empty with data", v.n);
    const size_t bytes = static_cast<size_t>(v.n) * dtype_size(v.dtype);
    auto dst = device_alloc(bytes, fmt::format("a [{}] vector", v.n));
    if (!dst) return tl::unexpected(dst.error());
    if (cudaError_t e = cudaMemcpy(*dst, v.data, bytes, cudaMemcpyHostToDevice); e != cudaSuccess) {
        return make_error("cuda upload: vector: {}", cuda_message(e));
    }
    vectors_.push_back(Vector{v.dtype, *dst, v.n});
    if (upload_observer_) upload_observer_(static_cast<int64_t>(bytes));
    return VectorId{static_cast<int32_t>(vectors_.size() - 1)};
}

Result<RopeId> CudaBackend::create_rope_table(int64_t rot_dim, double theta, const RopeScalingParams *llama3,
                                              int64_t n_positions) {
    // The table is the CPU's, built on the host (bit-identical cos/sin by construction) and made resident.
    cpu::RopeLlama3 l3;
    if (llama3 != nullptr) {
        l3.factor = llama3->factor;
        l3.low_freq_factor = llama3->low_freq_factor;
        l3.high_freq_factor = llama3->high_freq_factor;
        l3.original_max_position_embeddings = llama3->original_max_position_embeddings;
    }
    auto inv = cpu::rope_inv_freq(rot_dim, theta, llama3 != nullptr ? &l3 : nullptr);
    if (!inv) return tl::unexpected(inv.error());
    ThreadPool one(1);
    auto table = cpu::rope_table_build(one, *inv, n_positions);
    if (!table) return tl::unexpected(table.error());
    // Device layout: cos [n_positions, half] then sin [n_positions, half].
    const size_t half_bytes = table->cos.size() * sizeof(float);
    auto dst = device_alloc(2 * half_bytes, fmt::format("a RoPE table of {} positions", n_positions));
    if (!dst) return tl::unexpected(dst.error());
    auto *cos_d = static_cast<float *>(*dst);
    cudaError_t e = cudaMemcpy(cos_d, table->cos.data(), half_bytes, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(cos_d + table->cos.size(), table->sin.data(), half_bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) return make_error("cuda RoPE table: {}", cuda_message(e));
    ropes_.push_back(Rope{cos_d, cos_d + table->cos.size(), table->half, n_positions});
    return RopeId{static_cast<int32_t>(ropes_.size() - 1)};
}

Result<KvPoolId> CudaBackend::create_kv_pool(const KvPoolSpec &spec) {
    auto layout = kv_page_layout(spec);
    if (!layout) return wrap_error("cuda KV pool", layout.error());
    const int64_t bytes = kv_pool_bytes(spec, *layout);
    auto p = device_alloc(static_cast<size_t>(bytes), fmt::format("a KV pool of {} pages", spec.n_pages));
    if (!p) return tl::unexpected(p.error());
    TensorView storage;
    storage.data = *p;
    storage.dtype = DType::kU8;
    storage.device = Device::kCuda;
    storage.device_index = device_;
    storage.rank = 1;
    storage.shape[0] = bytes;
    kv_pools_.push_back(KvPool{spec, std::move(*layout), storage});
    return KvPoolId{static_cast<int32_t>(kv_pools_.size() - 1)};
}

const CudaBackend::KvPool &CudaBackend::kv_pool(KvPoolId id) const {
    MEMRA_CHECK(id.id >= 0 && static_cast<size_t>(id.id) < kv_pools_.size(), "cuda: unknown KV pool handle {}", id.id);
    return kv_pools_[static_cast<size_t>(id.id)];
}

TensorView CudaBackend::kv_pool_storage(KvPoolId pool) const { return kv_pool(pool).storage; }

const CudaMatrix &CudaBackend::matrix(MatrixId id) const {
    MEMRA_CHECK(id.id >= 0 && static_cast<size_t>(id.id) < matrices_.size(), "cuda: unknown matrix handle {}", id.id);
    return matrices_[static_cast<size_t>(id.id)];
}

const CudaBank &CudaBackend::bank(BankId id) const {
    MEMRA_CHECK(id.id >= 0 && static_cast<size_t>(id.id) < banks_.size(), "cuda: unknown bank handle {}", id.id);
    return banks_[static_cast<size_t>(id.id)];
}

const CudaBackend::Vector &CudaBackend::vector(VectorId id) const {
    MEMRA_CHECK(id.id >= 0 && static_cast<size_t>(id.id) < vectors_.size(), "cuda: unknown vector handle {}", id.id);
    return vectors_[static_cast<size_t>(id.id)];
}

void CudaBackend::copy_from_host(const void *src, TensorView dst) {
    MEMRA_CHECK(!capturing_, "cuda: a host copy inside a recorded step");
    settle_side();
    ++counters_.h2d_copies;
    counters_.copy_bytes += static_cast<int64_t>(dst.n_bytes());
    if (dst.n_bytes() == 0) return;
    // Synchronous with respect to the host buffer (pageable memory: staged before the call returns), ordered on
    // the stream after the work before it.
    const cudaError_t e = cudaMemcpyAsync(dst.data, src, dst.n_bytes(), cudaMemcpyHostToDevice, stream_);
    MEMRA_CHECK(e == cudaSuccess, "cuda copy_from_host of {} bytes: {}", dst.n_bytes(), cuda_message(e));
    if (profile_) {
        cudaStreamSynchronize(stream_);
        profile_mark();
    }
}

void CudaBackend::copy_to_host(TensorView src, void *dst) {
    MEMRA_CHECK(!capturing_, "cuda: a host copy inside a recorded step");
    settle_side();
    ++counters_.d2h_copies;
    counters_.copy_bytes += static_cast<int64_t>(src.n_bytes());
    if (src.n_bytes() == 0) return;
    int32_t flag = 0;
    cudaError_t e = cudaMemcpyAsync(dst, src.data, src.n_bytes(), cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaMemcpyAsync(&flag, error_flag_, sizeof(flag), cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    MEMRA_CHECK(e == cudaSuccess, "cuda copy_to_host of {} bytes: {}", src.n_bytes(), cuda_message(e));
    // A kernel met an index outside its range: an invariant the engine keeps is broken (the CPU ops abort).
    MEMRA_CHECK(flag == 0, "cuda: a kernel read an index outside its range (a token id, position, slot or row)");
    profile_mark();
}


// ---- Ops: shape checks as CpuBackend's (MEMRA_CHECK), then one launch each. ----

namespace {

float *f32(TensorView v) { return static_cast<float *>(v.data); }
const int32_t *i32c(TensorView v) { return static_cast<const int32_t *>(v.data); }
int32_t *i32(TensorView v) { return static_cast<int32_t *>(v.data); }

using op_checks::same_shape;

}  // namespace

Result<void> CudaBackend::embedding(MatrixId table, TensorView ids, TensorView out) {
    const CudaMatrix &w = matrix(table);
    MEMRA_CHECK(w.rows == w.full_rows && w.cols == w.k_full, "embedding: the table must be uploaded whole");
    MEMRA_CHECK(ids.numel() == out.rows() && out.row_elems() == w.cols, "embedding: {} ids, out [{}, {}], table [{}, {}]",
                ids.numel(), out.rows(), out.row_elems(), w.rows, w.cols);
    // Ids were checked against the vocabulary when the step was planned; one outside it would raise the flag.
    launched("embedding", cuda::embedding(w.data, w.dtype, w.rows, w.cols, i32c(ids), ids.numel(), f32(out),
                                          error_flag_, op_stream()));
    return {};
}

void CudaBackend::rms_norm(TensorView x, VectorId w, float eps, TensorView y) {
    same_shape("rms_norm", x, y);
    const Vector &v = vector(w);
    op_checks::norm_weight("rms_norm", v.n, x);
    launched("rms_norm", cuda::rms_norm(f32(x), x.rows(), x.row_elems(), v.dtype, v.data, eps, f32(y), op_stream()));
}

void CudaBackend::rms_norm_heads(TensorView x, int64_t n_heads, int64_t head_dim, VectorId w, float eps) {
    const Vector &v = vector(w);
    op_checks::rms_norm_heads(x, n_heads, head_dim, v.n);
    launched("rms_norm_heads", cuda::rms_norm_heads(f32(x), x.rows(), x.row_elems(), n_heads, head_dim, v.dtype, v.data,
                                                    eps, op_stream()));
}

CudaBackend::QkArgs CudaBackend::qk_args(const char *op, TensorView q, int64_t n_heads, VectorId q_norm, TensorView k,
                                         int64_t n_kv_heads, VectorId k_norm, int64_t head_dim, RopeId table,
                                         TensorView positions) const {
    const Vector &vq = vector(q_norm);
    const Vector &vk = vector(k_norm);
    op_checks::rms_norm_heads(q, n_heads, head_dim, vq.n);
    op_checks::rms_norm_heads(k, n_kv_heads, head_dim, vk.n);
    MEMRA_CHECK(q.rows() == k.rows(), "{}: q has {} rows, k {}", op, q.rows(), k.rows());
    QkArgs a{{f32(q), q.row_elems(), n_heads, vq.dtype, vq.data},
             {f32(k), k.row_elems(), n_kv_heads, vk.dtype, vk.data},
             {}};
    if (table.valid()) {
        MEMRA_CHECK(static_cast<size_t>(table.id) < ropes_.size(), "{}: unknown table {}", op, table.id);
        op_checks::rope(q, n_heads, head_dim, positions);
        op_checks::rope(k, n_kv_heads, head_dim, positions);
        const Rope &r = ropes_[static_cast<size_t>(table.id)];
        a.rope = {r.cos, r.sin, r.n_positions, r.half, static_cast<const int64_t *>(positions.data)};
    }
    return a;
}

void CudaBackend::qk_norm_rope(TensorView q, int64_t n_heads, VectorId q_norm, TensorView k, int64_t n_kv_heads,
                               VectorId k_norm, int64_t head_dim, float eps, RopeId table, TensorView positions) {
    const QkArgs a = qk_args("qk_norm_rope", q, n_heads, q_norm, k, n_kv_heads, k_norm, head_dim, table, positions);
    launched("qk_norm_rope", cuda::qk_norm_rope(a.q, a.k, q.rows(), head_dim, eps, a.rope, error_flag_, op_stream()));
}

void CudaBackend::attention_prologue(const AttentionInputs &a) {
    const KvPool &kp = kv_pool(a.pool);
    const bool blocks =
        kv_format_is_block(kp.spec.k_format) || kv_format_is_block(kp.spec.v_format) || a.q_round == RowRounding::kQ8;
    if (blocks && a.head_dim % kQuantBlock != 0) {  // blocks of 32 across heads: the three launches
        Backend::attention_prologue(a);
        return;
    }
    const QkArgs qk = qk_args("attention_prologue", a.q, a.n_heads, a.q_norm, a.k, a.n_kv_heads, a.k_norm, a.head_dim,
                              a.table, a.positions);
    const cpu::PagedLayer pl = kv_rows(kp, a.layer, a.k, a.v, a.slots);
    launched("attention_prologue",
             cuda::attention_prologue(qk.q, qk.k, f32(a.v), a.v.row_elems(), a.q.rows(), a.head_dim, a.eps, qk.rope,
                                      a.q_round, pl, i32c(a.slots), error_flag_, op_stream()));
}

void CudaBackend::add_rms_norm(TensorView x, TensorView r, VectorId w, float eps, TensorView h, TensorView y) {
    same_shape("add_rms_norm", x, r);
    same_shape("add_rms_norm", x, h);
    same_shape("add_rms_norm", x, y);
    const Vector &v = vector(w);
    op_checks::norm_weight("add_rms_norm", v.n, x);
    launched("add_rms_norm", cuda::add_rms_norm(f32(x), f32(r), x.rows(), x.row_elems(), v.dtype, v.data, eps, f32(h),
                                                f32(y), op_stream()));
}

void CudaBackend::residual_add(TensorView a, TensorView b, TensorView out) {
    same_shape("residual_add", a, b);
    same_shape("residual_add", a, out);
    launched("residual_add", cuda::residual_add(f32(a), f32(b), a.rows(), a.row_elems(), f32(out), op_stream()));
}

void CudaBackend::matmul(TensorView x, MatrixId w, TensorView y) {
    const CudaMatrix &m = matrix(w);
    op_checks::matmul("matmul", x, m.rows, m.cols, y);
    launched_product("matmul", cuda_matmul(m, f32(x), x.rows(), f32(y), op_stream()), m, x.rows());
}

void CudaBackend::matmul_multi(TensorView x, std::span<const MatrixId> w, std::span<const TensorView> y) {
    MEMRA_CHECK(w.size() == y.size(), "matmul_multi: {} matrices but {} outputs", w.size(), y.size());
    const CudaMatrix *ms[kMaxMultiParts] = {};
    float *ys[kMaxMultiParts] = {};
    const int n = static_cast<int>(w.size());
    cudaError_t e = cudaErrorNotSupported;
    if (n <= kMaxMultiParts) {
        for (int i = 0; i < n; ++i) {
            ms[i] = &matrix(w[static_cast<size_t>(i)]);
            op_checks::matmul("matmul_multi", x, ms[i]->rows, ms[i]->cols, y[static_cast<size_t>(i)]);
            ys[i] = f32(y[static_cast<size_t>(i)]);
        }
        e = cuda_matmul_multi(ms, ys, n, f32(x), x.rows(), op_stream());
    }
    if (e == cudaErrorNotSupported) {  // not one launch: each product as matmul runs it
        Backend::matmul_multi(x, w, y);
        return;
    }
    if (!profile_) {
        launched("matmul_multi", e);
        return;
    }
    // One profile row per shape list and token count, with the parts' weight bytes.
    std::string key = "matmul_multi BF16 [";
    int64_t bytes = 0;
    for (int i = 0; i < n; ++i) {
        key += fmt::format("{}{}", i == 0 ? "" : "+", ms[i]->rows);
        bytes += ms[i]->rows * ms[i]->cols * 2;
    }
    key += fmt::format(", {}] x{}", ms[0]->cols, x.rows());
    launched(key.c_str(), e);
    op_times_[key].weight_bytes += bytes;
}

int64_t CudaBackend::canonical_workspace_floats(int64_t, MatrixId) const { return 0; }

void CudaBackend::matmul_canonical(TensorView x, MatrixId w, TensorView y, TensorView) {
    const CudaMatrix &m = matrix(w);
    op_checks::matmul("matmul_canonical", x, m.rows, m.cols, y);
    launched_product("matmul_canonical", cuda_matmul_canonical(m, f32(x), x.rows(), f32(y), op_stream()), m, x.rows());
}

void CudaBackend::matmul_grouped_pair(TensorView x, BankId a, BankId b, TensorView offsets, TensorView y_a,
                                      TensorView y_b) {
    const CudaBank &ba = bank(a);
    const CudaBank &bb = bank(b);
    op_checks::grouped("matmul_grouped_pair", x, ba.n_experts, ba.rows, ba.cols, ba.first_expert, offsets, y_a);
    op_checks::grouped("matmul_grouped_pair", x, bb.n_experts, bb.rows, bb.cols, bb.first_expert, offsets, y_b);
    if (x.rows() > 0) counters_.launches += cuda_matmul_grouped_pair_launches(ba, bb, x.rows(), e4m3_scratch_) - 1;
    launched("matmul_grouped_pair", cuda_matmul_grouped_pair(ba, bb, f32(x), x.rows(), i32c(offsets), offsets.numel(),
                                                             f32(y_a), f32(y_b), e4m3_scratch_, op_stream()));
}

void CudaBackend::matmul_grouped(TensorView x, BankId b, TensorView offsets, TensorView y) {
    const CudaBank &bk = bank(b);
    op_checks::grouped("matmul_grouped", x, bk.n_experts, bk.rows, bk.cols, bk.first_expert, offsets, y);
    if (x.rows() > 0) counters_.launches += cuda_matmul_grouped_launches(bk, x.rows(), e4m3_scratch_) - 1;
    launched("matmul_grouped", cuda_matmul_grouped(bk, f32(x), x.rows(), i32c(offsets), offsets.numel(), f32(y),
                                                   e4m3_scratch_, op_stream()));
}

void CudaBackend::matmul_grouped_swiglu(TensorView gate, TensorView up, float limit, BankId b, TensorView offsets,
                                        TensorView y) {
    const CudaBank &bk = bank(b);
    same_shape("matmul_grouped_swiglu", gate, up);
    op_checks::grouped("matmul_grouped_swiglu", gate, bk.n_experts, bk.rows, bk.cols, bk.first_expert, offsets, y);
    if (gate.rows() > 0) counters_.launches += cuda_matmul_grouped_swiglu_launches(bk, gate.rows(), e4m3_scratch_) - 1;
    launched("matmul_grouped_swiglu",
             cuda_matmul_grouped_swiglu(bk, f32(gate), f32(up), limit, gate.rows(), i32c(offsets), offsets.numel(),
                                        f32(y), e4m3_scratch_, op_stream()));
}

void CudaBackend::canonical_combine(TensorView subtree_sums, TensorView out) {
    op_checks::canonical_combine(subtree_sums, out);
    launched("canonical_combine",
             cuda::canonical_combine(f32(subtree_sums), subtree_sums.rows(), out.numel(), f32(out), op_stream()));
}

void CudaBackend::join_col_shards(TensorView shards, TensorView out) {
    op_checks::join_col_shards(shards, out);
    launched("join_col_shards",
             cuda::join_col_shards(shards.data, shards.dim(0), shards.dim(1), shards.dim(2),
                                   static_cast<int64_t>(dtype_size(out.dtype)), out.data, op_stream()));
}

void CudaBackend::rope(RopeId table, TensorView x, int64_t n_heads, int64_t head_dim, TensorView positions) {
    MEMRA_CHECK(table.id >= 0 && static_cast<size_t>(table.id) < ropes_.size(), "rope: unknown table {}", table.id);
    op_checks::rope(x, n_heads, head_dim, positions);
    const Rope &r = ropes_[static_cast<size_t>(table.id)];
    launched("rope", cuda::rope(r.cos, r.sin, r.n_positions, r.half, f32(x), x.rows(), x.row_elems(), n_heads, head_dim,
                                static_cast<const int64_t *>(positions.data), error_flag_, op_stream()));
}

cpu::PagedLayer CudaBackend::paged_layer(const KvPool &pool, int layer) const {
    return cpu::pool_layer(pool.spec, pool.layout, static_cast<std::byte *>(pool.storage.data), layer);
}

void CudaBackend::paged_attention(const AttentionParams &p, TensorView q, TensorView q_pos, TensorView q_seq,
                                  KvPoolId pool, int layer, TensorView block_tables, int64_t first_pos, TensorView gate,
                                  TensorView out) {
    const KvPool &kp = kv_pool(pool);
    const cpu::PagedLayer pl = paged_layer(kp, layer);
    const int64_t row = p.n_heads * p.head_dim;
    op_checks::paged_attention(p, q, q_pos, q_seq, layer, kp.layout.row_elems[static_cast<size_t>(layer)],
                               block_tables, gate, out);
    const bool gated = gate.data != nullptr;
    cpu::AttentionShape shape{p.n_heads, p.n_kv_heads, p.head_dim, p.window, cpu::attention_scale(p.head_dim)};
    shape.blocked = true;
    launched("paged_attention",
             cuda::paged_attention(shape, f32(q), row, static_cast<const int64_t *>(q_pos.data), i32c(q_seq), q.rows(),
                                   pl, i32c(block_tables), block_tables.row_elems(), block_tables.rows(), first_pos,
                                   gated ? f32(gate) : nullptr, p.n_heads, f32(out), error_flag_, op_stream(),
                                   attention_split_, kAttentionSplitFloats));
}

cpu::PagedLayer CudaBackend::kv_rows(const KvPool &kp, int layer, TensorView k, TensorView v, TensorView slots) const {
    const cpu::PagedLayer pl = paged_layer(kp, layer);  // checks the layer
    op_checks::kv_write(k, v, slots, layer, kp.layout.row_elems[static_cast<size_t>(layer)]);
    return pl;
}

void CudaBackend::kv_write(KvPoolId pool, int layer, TensorView k, TensorView v, TensorView slots) {
    const KvPool &kp = kv_pool(pool);
    const cpu::PagedLayer pl = kv_rows(kp, layer, k, v, slots);
    launched("kv_write", cuda::kv_write(pl, kp.layout.row_elems[static_cast<size_t>(layer)], f32(k), f32(v),
                                        i32c(slots), k.rows(), error_flag_, op_stream()));
}

void CudaBackend::round_rows(TensorView x, RowRounding r) {
    launched("round_rows", cuda::round_rows(f32(x), x.rows(), x.row_elems(), r, op_stream()));
}

void CudaBackend::swiglu(TensorView gate, TensorView up, float limit, TensorView out) {
    same_shape("swiglu", gate, up);
    same_shape("swiglu", gate, out);
    launched("swiglu", cuda::swiglu(f32(gate), f32(up), gate.row_elems(), gate.rows(), gate.row_elems(), limit,
                                    f32(out), op_stream()));
}

void CudaBackend::router_topk(const RouterConfig &cfg, TensorView logits, VectorId bias, TensorView expert_ids,
                              TensorView weights) {
    const Vector &b = vector(bias);
    op_checks::router_topk(cfg, logits, b.dtype, b.n, expert_ids, weights);
    launched("router_topk",
             cuda::router_topk(f32(logits), static_cast<const float *>(b.data), logits.rows(), cfg.n_experts, cfg.top_k,
                               cfg.renormalize, cfg.scaling_factor, i32(expert_ids), f32(weights), op_stream()));
}

void CudaBackend::moe_sort_pairs(TensorView expert_ids, int64_t n_experts, TensorView offsets, TensorView sorted_pair,
                                 TensorView row_of_pair) {
    op_checks::moe_sort_pairs(expert_ids, n_experts, offsets, sorted_pair, row_of_pair);
    launched("moe_sort_pairs",
             cuda::moe_sort_pairs(i32c(expert_ids), expert_ids.rows(), expert_ids.row_elems(), n_experts, i32(offsets),
                                  i32(sorted_pair), i32(row_of_pair), error_flag_, op_stream()));
}

void CudaBackend::moe_permute(TensorView x, TensorView sorted_pair, TensorView offsets, int64_t expert_begin,
                              int64_t expert_end, int64_t top_k, TensorView x_own) {
    op_checks::moe_permute(x, sorted_pair, offsets, expert_begin, expert_end, top_k, x_own);
    launched("moe_permute",
             cuda::moe_permute(f32(x), x.rows(), x.row_elems(), i32c(sorted_pair), i32c(offsets), offsets.numel() - 1,
                               expert_begin, expert_end, top_k, f32(x_own), x_own.rows(), error_flag_, op_stream()));
}

void CudaBackend::moe_source_rows(TensorView expert_ids, TensorView row_of_pair, TensorView offsets, int64_t n_owners,
                                  int64_t capacity, TensorView src_row) {
    const int64_t n_experts = offsets.numel() - 1;
    op_checks::moe_source_rows(expert_ids, row_of_pair, offsets, n_owners, capacity, src_row);
    launched("moe_source_rows",
             cuda::moe_source_rows(i32c(expert_ids), i32c(row_of_pair), expert_ids.numel(), i32c(offsets), n_experts,
                                   n_owners, capacity, i32(src_row), error_flag_, op_stream()));
}

void CudaBackend::moe_route(TensorView x, MatrixId router, const RouterConfig &cfg, VectorId bias,
                            const MoeRouteViews &r) {
    const CudaMatrix &m = matrix(router);
    const Vector &b = vector(bias);
    op_checks::matmul("moe_route", x, m.rows, m.cols, r.logits);
    op_checks::router_topk(cfg, r.logits, b.dtype, b.n, r.expert_ids, r.weights);
    op_checks::moe_sort_pairs(r.expert_ids, cfg.n_experts, r.offsets, r.sorted_pair, r.row_of_pair);
    op_checks::moe_source_rows(r.expert_ids, r.row_of_pair, r.offsets, r.n_owners, r.capacity, r.src_row);
    if (!cuda::moe_route_covers(m, x.rows(), cfg.top_k)) {  // shapes the fused kernel does not take: the four ops
        Backend::moe_route(x, router, cfg, bias, r);
        return;
    }
    const cuda::MoeRouteBuffers out{f32(r.logits),      i32(r.expert_ids),  f32(r.weights), i32(r.offsets),
                                    i32(r.sorted_pair), i32(r.row_of_pair), i32(r.src_row)};
    launched("moe_route", cuda::moe_route(m, f32(x), x.rows(), static_cast<const float *>(b.data), cfg.top_k,
                                          cfg.renormalize, cfg.scaling_factor, r.n_owners, r.capacity, out,
                                          route_tickets_, error_flag_, op_stream()));
}

void CudaBackend::moe_combine(TensorView h, TensorView expert_out, TensorView src_row, TensorView weights,
                              TensorView shared, TensorView out) {
    op_checks::moe_combine(h, expert_out, src_row, weights, shared, out);
    const int64_t top_k = weights.row_elems();
    const bool has_shared = shared.data != nullptr;
    launched("moe_combine", cuda::moe_combine(f32(h), f32(expert_out), expert_out.rows(), i32c(src_row), f32(weights),
                                              has_shared ? f32(shared) : nullptr, h.rows(), top_k, h.row_elems(),
                                              f32(out), error_flag_, op_stream()));
}

void CudaBackend::gather_rows(TensorView src, TensorView rows, TensorView dst) {
    op_checks::gather_rows(src, rows, dst);
    launched("gather_rows",
             cuda::gather_rows(src.data, src.rows(), i32c(rows), rows.numel(), src.row_elems(),
                               static_cast<int64_t>(dtype_size(src.dtype)), dst.data, error_flag_, op_stream()));
}

void CudaBackend::scatter_rows(TensorView src, TensorView rows, TensorView dst) {
    op_checks::scatter_rows(src, rows, dst);
    launched("scatter_rows", cuda::scatter_rows(src.data, i32c(rows), rows.numel(), src.row_elems(),
                                                static_cast<int64_t>(dtype_size(src.dtype)), dst.data, dst.rows(),
                                                error_flag_, op_stream()));
}

void CudaBackend::scatter_ids(TensorView tokens, TensorView pairs, TensorView dst) {
    const int64_t n_tokens = op_checks::scatter_ids(tokens, pairs, dst);
    if (forcing_ != nullptr) {
        // Stage k of a step scatters draft k: impose the forced one first (cpu::ForcedDraftBackend's rule).
        if (forcing_seen_ != forcing_->step) {
            forcing_seen_ = forcing_->step;
            forcing_stage_ = 0;
        }
        const int k = forcing_stage_++;
        if (k < 3 && forcing_->ids[static_cast<size_t>(k)] >= 0 && pairs.numel() >= 2) {
            launched("force_draft",
                     cuda::force_draft_id(tokens.data, n_tokens, static_cast<int64_t>(sizeof(SampledToken)),
                                          i32c(pairs), forcing_->ids[static_cast<size_t>(k)], op_stream()));
        }
    }
    launched("scatter_ids",
             cuda::scatter_ids(tokens.data, n_tokens, static_cast<int64_t>(sizeof(SampledToken)), i32c(pairs),
                               pairs.numel() / 2, i32(dst), dst.numel(), error_flag_, op_stream()));
}

void CudaBackend::concat_cols(TensorView a, TensorView b, TensorView out) {
    op_checks::concat_cols(a, b, out);
    launched("concat_cols", cuda::concat_cols(a.data, a.row_elems(), b.data, b.row_elems(), a.rows(),
                                              static_cast<int64_t>(dtype_size(out.dtype)), out.data, op_stream()));
}

Result<void> CudaBackend::prepare_sampling(int32_t vocab_size) {
    if (vocab_size < 1) return make_error("cuda sampling workspace: vocabulary of {} ids", vocab_size);
    const int64_t bytes = sample_workspace_bytes(vocab_size, kSampleSlots);
    auto ws = device_alloc(static_cast<size_t>(bytes), fmt::format("the sampling workspace ({} ids)", vocab_size));
    if (!ws) return tl::unexpected(ws.error());
    sample_workspace_ = *ws;
    sample_workspace_bytes_ = bytes;
    sample_vocab_ = vocab_size;
    return {};
}

void CudaBackend::sample(TensorView logits, int32_t n_valid, TensorView rows, TensorView history, TensorView bias,
                         TensorView out) {
    const int64_t n = op_checks::sample(logits, n_valid, rows, bias, out, sample_vocab_);
    const auto n_bias = static_cast<int64_t>(bias.n_bytes() / sizeof(LogitBias));
    launched("sample",
             cuda::sample(f32(logits), logits.rows(), logits.row_elems(), n_valid,
                          static_cast<const SampleRow *>(rows.data), n, history.numel() > 0 ? i32c(history) : nullptr,
                          history.numel(), n_bias > 0 ? static_cast<const LogitBias *>(bias.data) : nullptr, n_bias,
                          static_cast<SampledToken *>(out.data), sample_workspace_, sample_workspace_bytes_,
                          sample_vocab_, error_flag_, op_stream()));
}

}  // namespace memra::cuda
