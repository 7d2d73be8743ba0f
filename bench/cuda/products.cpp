// GPU products and norms at decode shapes (PERFORMANCE.md K1), timed with CUDA events: each benchmark
// launches the op back to back and reports its mean time per launch, the weight bytes it streamed per second
// (weight_GB/s) and the ratio of that rate to a device-to-device copy moving the same bytes, timed the same way
// (vs_copy: the copy reads and writes, so its bytes are counted twice). Shapes are the release architecture's
// (d_model 4096): q/k/v/gate-width products, the dense MLP's 11264-row gate/up, the lm_head, the canonical
// o_proj/down_proj (K 12288 in 8 blocks), at 1, 8 and 64 tokens (decode) and 512 (prefill; with TFLOP/s); the FP8
// experts of one token (K3), decode attention (K9, K10: one row; K8: 32 and 128 sequences; bf16 KV on the tensor
// cores, q8_0 / q5_1 on the CUDA-core kernel) and causal prefill attention (K7: 512, 2048 and 8192 positions), and
// one MoE layer's routing (K6), and the sampling op over E128's vocabulary. Random bf16
// weights (the values do not change the work), in copies that exceed the L2 and take turns, so every launch streams
// from HBM.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include "backend/cuda/ops_attention.h"
#include "backend/cuda/ops_matmul.h"
#include "backend/cuda/ops_route.h"
#include "backend/cuda/ops_rows.h"
#include "backend/cuda/ops_sample.h"
#include "core/kv_page.h"
#include "core/quant_blocks.h"

namespace memra {
namespace {

constexpr size_t kRotateBytes = size_t{120} << 20;

bool gpu_present() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A device buffer of `bytes` bytes; with `bf16_values`, random bf16 of magnitude 2^-8 .. 2^0 (never denormal,
// never NaN) in a 1 MiB pattern repeated over the buffer.
struct DeviceBlock {
    void *ptr = nullptr;
    DeviceBlock(size_t bytes, bool bf16_values) {
        if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
            ptr = nullptr;
            return;
        }
        if (!bf16_values) return;
        std::vector<uint16_t> pattern(size_t{1} << 19);
        std::mt19937 rng(7);
        for (uint16_t &h : pattern) {
            h = static_cast<uint16_t>(((rng() & 1u) << 15) | ((119u + rng() % 8u) << 7) | (rng() & 0x7fu));
        }
        for (size_t at = 0; at < bytes; at += pattern.size() * 2) {
            const size_t n = std::min(pattern.size() * 2, bytes - at);
            cudaMemcpy(static_cast<char *>(ptr) + at, pattern.data(), n, cudaMemcpyHostToDevice);
        }
    }
    ~DeviceBlock() { cudaFree(ptr); }
    DeviceBlock(const DeviceBlock &) = delete;
    DeviceBlock &operator=(const DeviceBlock &) = delete;
};

// Copies of a weight (or KV pool) of `bytes` bytes (random bf16 patterns) that together exceed the 60 MB L2
// twice, used in turn by a benchmark so that every launch reads from HBM.
std::vector<std::unique_ptr<DeviceBlock>> rotating_weights(size_t bytes) {
    std::vector<std::unique_ptr<DeviceBlock>> w;
    const size_t copies = std::max<size_t>(1, (kRotateBytes + bytes - 1) / bytes);
    for (size_t i = 0; i < copies; ++i) w.push_back(std::make_unique<DeviceBlock>(bytes, true));
    return w;
}

// A device copy of `host`.
template <class T>
std::unique_ptr<DeviceBlock> device_copy(const std::vector<T> &host) {
    auto d = std::make_unique<DeviceBlock>(host.size() * sizeof(T), false);
    cudaMemcpy(d->ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    return d;
}

// n f32 activations uniform in [-2, 2).
std::unique_ptr<DeviceBlock> random_activations(int64_t n, uint32_t seed) {
    std::vector<float> hx(static_cast<size_t>(n));
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (float &v : hx) v = u(rng);
    return device_copy(hx);
}

// Mean seconds per call of `launch` over `reps` back-to-back launches on the default stream, after 3 warm-ups.
template <class F>
double time_launches(const F &launch, int reps) {
    for (int i = 0; i < 3; ++i) launch();
    cudaEvent_t a = nullptr;
    cudaEvent_t b = nullptr;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, nullptr);
    for (int i = 0; i < reps; ++i) launch();
    cudaEventRecord(b, nullptr);
    cudaEventSynchronize(b);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return static_cast<double>(ms) * 1e-3 / reps;
}

// Seconds of a device-to-device copy of `bytes` bytes (the same timing): the ceiling a streaming op can reach.
double copy_seconds(size_t bytes) {
    DeviceBlock src(bytes, false);
    DeviceBlock dst(bytes, false);
    return time_launches([&] { cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, nullptr); }, 20);
}

// The benchmark's iterations, each the mean of `reps` launches of `launch` (manual time); returns the last mean.
template <class F>
double time_state(benchmark::State &state, const F &launch, int reps) {
    double seconds = 0.0;
    for (auto _ : state) {
        seconds = time_launches(launch, reps);
        state.SetIterationTime(seconds);
    }
    return seconds;
}

// Times 20 launches of `launch` and reports them with the weight bytes each streams (weight_GB/s, vs_copy) and,
// where given, the floating-point operations each does (TFLOP/s).
template <class F>
void time_and_report(benchmark::State &state, const F &launch, double weight_bytes, double flops = 0.0) {
    const double seconds = time_state(state, launch, 20);
    state.counters["weight_GB/s"] = weight_bytes / seconds * 1e-9;
    if (flops > 0.0) state.counters["TFLOP/s"] = flops / seconds * 1e-12;
    const double copy_rate = 2.0 * weight_bytes / copy_seconds(static_cast<size_t>(weight_bytes));
    state.counters["vs_copy"] = (weight_bytes / seconds) / copy_rate;
}

// A whole [rows, k] matrix of `dtype` (its data set by the caller).
cuda::CudaMatrix dense_matrix(DType dtype, int64_t rows, int64_t k, cuda::ActRounding act) {
    return cuda::CudaMatrix{.dtype = dtype, .rows = rows, .cols = k, .full_rows = rows, .k_full = k, .act = act};
}

// Times a dense product [rows, k] of `dtype` weights (rotating copies) over `tokens` rows of x.
void time_product(benchmark::State &state, DType dtype, cuda::ActRounding act, int64_t rows, int64_t k,
                  int64_t tokens, bool canonical) {
    if (!gpu_present()) {
        state.SkipWithError("no CUDA device");
        return;
    }
    const size_t weight_bytes = static_cast<size_t>(rows * k * (dtype == DType::kF32 ? 4 : 2));
    const auto w = rotating_weights(weight_bytes);
    const auto x = random_activations(tokens * k, 3);
    DeviceBlock y(static_cast<size_t>(tokens * rows * 4), false);
    cuda::CudaMatrix m = dense_matrix(dtype, rows, k, act);
    size_t turn = 0;
    const auto launch = [&] {
        m.data = w[turn++ % w.size()]->ptr;
        const auto *xp = static_cast<const float *>(x->ptr);
        auto *yp = static_cast<float *>(y.ptr);
        const cudaError_t e = canonical ? cuda::cuda_matmul_canonical(m, xp, tokens, yp, nullptr)
                                        : cuda::cuda_matmul(m, xp, tokens, yp, nullptr);
        if (e != cudaSuccess) std::fprintf(stderr, "product: %s\n", cudaGetErrorString(e));
    };
    time_and_report(state, launch, static_cast<double>(weight_bytes), 2.0 * static_cast<double>(rows * k * tokens));
}

// args: rows, K, tokens, canonical (0/1).
void bm_bf16_product(benchmark::State &state) {
    time_product(state, DType::kBF16, cuda::ActRounding::kBf16, state.range(0), state.range(1), state.range(2),
                 state.range(3) != 0);
}

// args: set, fused (0/1), tokens. Products of one x by several bf16 matrices of K 4096 (rotating copies): set 0
// the E128 SWA layer's q, k, v and head gate ([12288 | 1024 | 1024 | 96]), set 1 the shared expert's gate and up
// ([1280 | 1280]), set 2 the full-attention layer's ([8192 | 1024 | 1024 | 64]); as one launch per matrix
// (cuda_matmul) or one for all (cuda_matmul_multi).
void bm_bf16_multi(benchmark::State &state) {
    if (!gpu_present()) {
        state.SkipWithError("no CUDA device");
        return;
    }
    constexpr int64_t kK = 4096;
    const std::vector<int64_t> rows = state.range(0) == 0   ? std::vector<int64_t>{12288, 1024, 1024, 96}
                                      : state.range(0) == 1 ? std::vector<int64_t>{1280, 1280}
                                                            : std::vector<int64_t>{8192, 1024, 1024, 64};
    const bool fused = state.range(1) != 0;
    const int64_t tokens = state.range(2);
    const int n = static_cast<int>(rows.size());
    std::vector<std::vector<std::unique_ptr<DeviceBlock>>> w;
    std::vector<std::unique_ptr<DeviceBlock>> y;
    std::vector<cuda::CudaMatrix> m(rows.size());
    double weight_bytes = 0.0;
    for (int i = 0; i < n; ++i) {
        const auto r = rows[static_cast<size_t>(i)];
        w.push_back(rotating_weights(static_cast<size_t>(r * kK * 2)));
        y.push_back(std::make_unique<DeviceBlock>(static_cast<size_t>(tokens * r * 4), false));
        m[static_cast<size_t>(i)] = dense_matrix(DType::kBF16, r, kK, cuda::ActRounding::kBf16);
        weight_bytes += static_cast<double>(r * kK * 2);
    }
    const auto x = random_activations(tokens * kK, 3);
    const auto *xp = static_cast<const float *>(x->ptr);
    size_t turn = 0;
    const auto launch = [&] {
        const cuda::CudaMatrix *parts[cuda::kMaxMultiParts] = {};
        float *ys[cuda::kMaxMultiParts] = {};
        for (int i = 0; i < n; ++i) {
            const auto &wi = w[static_cast<size_t>(i)];
            m[static_cast<size_t>(i)].data = wi[turn % wi.size()]->ptr;
            parts[i] = &m[static_cast<size_t>(i)];
            ys[i] = static_cast<float *>(y[static_cast<size_t>(i)]->ptr);
        }
        ++turn;
        cudaError_t e = cudaSuccess;
        if (fused) {
            e = cuda::cuda_matmul_multi(parts, ys, n, xp, tokens, nullptr);
        } else {
            for (int i = 0; i < n && e == cudaSuccess; ++i) e = cuda::cuda_matmul(*parts[i], xp, tokens, ys[i], nullptr);
        }
        if (e != cudaSuccess) std::fprintf(stderr, "products: %s\n", cudaGetErrorString(e));
    };
    time_and_report(state, launch, weight_bytes, 2.0 * weight_bytes / 2.0 * static_cast<double>(tokens));
}

// args: rows (experts), tokens. The MoE router: f32 weights [experts, 4096] times f32 activations in the exact
// loop (the router stays f32 in device numerics), for E128 (128) and the release (288).
void bm_f32_router(benchmark::State &state) {
    time_product(state, DType::kF32, cuda::ActRounding::kNone, state.range(0), 4096, state.range(1), false);
}

// args: rows, K, experts, pairs. Routed experts (K3, K4, K5): FP8 experts [rows, K] with 128x128 scale tiles
// (W8A8: e4m3 activation groups of 128), `pairs` rows of x spread evenly over `experts` of them, as a step's
// grouped product runs them: 8 experts of one row each at batch 1; 128 experts of 2 rows at batch 32 (E128);
// 32 rows each at 512 tokens (prefill). The weight bytes count every expert with rows once; with few rows per
// expert the products are memory-bound (vs_copy), with many compute-bound (TFLOP/s).
void bm_e4m3_grouped(benchmark::State &state) {
    if (!gpu_present()) {
        state.SkipWithError("no CUDA device");
        return;
    }
    const int64_t rows = state.range(0);
    const int64_t k = state.range(1);
    const int64_t experts = state.range(2);
    const int64_t pairs = state.range(3);
    const size_t weight_bytes = static_cast<size_t>(experts * rows * k);
    const int64_t tiles = experts * ((rows + 127) / 128) * ((k + 127) / 128);
    // The bf16 patterns' bytes as e4m3 codes, NaN codes (0x7f, 0xff) among them: the work does not depend on them.
    const auto w = rotating_weights(weight_bytes);
    const auto scales = device_copy(std::vector<float>(static_cast<size_t>(tiles), 1.0f / 256.0f));
    const auto x = random_activations(pairs * k, 5);
    std::vector<int32_t> offsets(static_cast<size_t>(experts + 1));
    for (int64_t e = 0; e <= experts; ++e) offsets[static_cast<size_t>(e)] = static_cast<int32_t>(e * pairs / experts);
    const auto d_offsets = device_copy(offsets);
    DeviceBlock y(static_cast<size_t>(pairs * rows * 4), false);
    // The backend's scratch for the quantized activations.
    DeviceBlock codes(static_cast<size_t>(cuda::kE4m3ScratchCodeBytes), false);
    DeviceBlock qscales(static_cast<size_t>(cuda::kE4m3ScratchScaleFloats) * 4, false);
    const cuda::E4m3Scratch scratch{static_cast<uint8_t *>(codes.ptr), static_cast<float *>(qscales.ptr),
                                    cuda::kE4m3ScratchCodeBytes, cuda::kE4m3ScratchScaleFloats};
    cuda::CudaBank b;
    b.dtype = DType::kF8E4M3;
    b.n_experts = experts;
    b.rows = rows;
    b.cols = k;
    b.scale_inv = static_cast<const float *>(scales->ptr);
    b.act = cuda::ActRounding::kE4m3x128;
    size_t turn = 0;
    const auto launch = [&] {
        b.data = w[turn++ % w.size()]->ptr;
        const cudaError_t e = cuda::cuda_matmul_grouped(b, static_cast<const float *>(x->ptr), pairs,
                                                        static_cast<const int32_t *>(d_offsets->ptr), experts + 1,
                                                        static_cast<float *>(y.ptr), scratch, nullptr);
        if (e != cudaSuccess) std::fprintf(stderr, "grouped: %s\n", cudaGetErrorString(e));
    };
    time_and_report(state, launch, static_cast<double>(weight_bytes), 2.0 * static_cast<double>(pairs * rows * k));
}

// args: positions, query heads, window (0: full), split (0-3), q8q5 (0/1), batch, prefill (0/1). The release
// architecture's attention (8 kv heads of 128 in 64-row pages, bf16 K and V, or q8_0 K and q5_1 V with q8q5) over
// `batch` sequences, each `positions` long in pages of its own. Decode (prefill 0): one row per sequence, at its last
// position; K9 is a full layer at 8K positions (33.5 MB of bf16 K and V), K10 a sliding layer of 96 heads over its
// 512-position window at 4K, K8 32 or 128 sequences at 4K (537 MB / 2.1 GB of bf16 K and V). Prefill (1): every
// position's row of one sequence, causal (K7), with TFLOP/s over the causal products (4 head_dim heads S (S + 1) /
// 2). split 1 gives the split-KV launches a workspace for any shape and lets paged_attention pick (as the engine
// does), 2 a CTA per split, 3 a CTA per block; split 0 runs one launch per work item over every split (the same
// bits). KV_GB/s: the K and V bytes the rows see.
void bm_attention(benchmark::State &state) {
    if (!gpu_present()) {
        state.SkipWithError("no CUDA device");
        return;
    }
    const int64_t positions = state.range(0);
    const int64_t heads = state.range(1);
    const int64_t window = state.range(2);
    const int64_t split = state.range(3);
    const cuda::SplitCtas ctas =
        split == 2 ? cuda::SplitCtas::kSplits : (split == 3 ? cuda::SplitCtas::kBlocks : cuda::SplitCtas::kAuto);
    const bool quant = state.range(4) != 0;  // q8_0 keys and q5_1 values instead of bf16 ones
    const int64_t batch = state.range(5);
    const bool prefill = state.range(6) != 0;
    const int64_t rows = prefill ? positions : 1;  // query rows per sequence
    const int64_t n_q = batch * rows;
    constexpr int64_t kKvHeads = 8;
    constexpr int64_t kHeadDim = 128;
    constexpr int64_t kBlocks = kKvHeads * kHeadDim / kQuantBlock;  // of 32 values per row
    const int64_t k_row = quant ? kBlocks * static_cast<int64_t>(sizeof(BlockQ8_0)) : kKvHeads * kHeadDim * 2;
    const int64_t v_row = quant ? kBlocks * static_cast<int64_t>(sizeof(BlockQ5_1)) : kKvHeads * kHeadDim * 2;
    const int64_t seq_pages = (positions + kKvPageRows - 1) / kKvPageRows;
    const int64_t pages = batch * seq_pages;
    const cpu::PagedLayer layer{nullptr,
                               pages,
                               kKvPageRows * (k_row + v_row),
                               0,
                               kKvPageRows * k_row,
                               k_row,
                               v_row,
                               quant ? KvFormat::kQ8_0 : KvFormat::kBf16,
                               quant ? KvFormat::kQ5_1 : KvFormat::kBf16};
    const auto pools = rotating_weights(static_cast<size_t>(pages * layer.page_bytes));  // K and V from HBM
    cpu::PagedLayer l = layer;
    // Sequence s holds pages [s seq_pages, (s + 1) seq_pages): block tables [batch, seq_pages].
    std::vector<int32_t> table(static_cast<size_t>(pages));
    for (int64_t i = 0; i < pages; ++i) table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    const auto d_table = device_copy(table);
    // Query row i: sequence i / rows at position (positions - rows) + i % rows.
    std::vector<int64_t> pos(static_cast<size_t>(n_q));
    std::vector<int32_t> seqs(static_cast<size_t>(n_q));
    for (int64_t i = 0; i < n_q; ++i) {
        pos[static_cast<size_t>(i)] = positions - rows + i % rows;
        seqs[static_cast<size_t>(i)] = static_cast<int32_t>(i / rows);
    }
    const auto d_pos = device_copy(pos);
    const auto d_seq = device_copy(seqs);
    const auto q = random_activations(n_q * heads * kHeadDim, 9);
    DeviceBlock out(static_cast<size_t>(n_q * heads * kHeadDim * 4), false);
    cpu::AttentionShape shape{heads, kKvHeads, kHeadDim, window, 1.0f / 11.3137085f};
    shape.blocked = true;
    const int64_t ws_floats =
        split != 0 ? cuda::paged_attention_split_floats(
                         shape, n_q, seq_pages, split == 2 ? cuda::SplitCtas::kSplits : cuda::SplitCtas::kBlocks)
                   : 0;
    DeviceBlock ws(static_cast<size_t>(std::max<int64_t>(ws_floats, 1)) * 4, false);
    size_t turn = 0;
    const auto launch = [&] {
        l.base = static_cast<std::byte *>(pools[turn++ % pools.size()]->ptr);
        const cudaError_t e = cuda::paged_attention(
            shape, static_cast<const float *>(q->ptr), heads * kHeadDim, static_cast<const int64_t *>(d_pos->ptr),
            static_cast<const int32_t *>(d_seq->ptr), n_q, l, static_cast<const int32_t *>(d_table->ptr), seq_pages,
            batch, 0, nullptr, 0, static_cast<float *>(out.ptr), nullptr, nullptr,
            split != 0 ? static_cast<float *>(ws.ptr) : nullptr, ws_floats, ctas);
        if (e != cudaSuccess) std::fprintf(stderr, "attention: %s\n", cudaGetErrorString(e));
    };
    const int64_t seen = window > 0 ? std::min(window, positions) : positions;
    const double seconds = time_state(state, launch, prefill ? 3 : 20);
    state.counters["us"] = seconds * 1e6;
    state.counters["KV_GB/s"] = static_cast<double>(batch * seen * (k_row + v_row)) / seconds * 1e-9;
    if (prefill) {
        const double pairs = static_cast<double>(positions) * static_cast<double>(positions + 1) / 2.0;
        state.counters["TFLOP/s"] = 4.0 * static_cast<double>(kHeadDim * heads * batch) * pairs / seconds * 1e-12;
    }
}

// args: tokens, fused (0/1). K6, one MoE layer's routing of E128 (128 experts, top 8, d 4096) as the forward runs
// it, timed as a whole: fused, moe_route (the f32 router product, top-k, sort and source rows in one launch),
// moe_permute (every expert owned) and moe_combine (with a shared-expert row); not fused, the router product,
// router_topk, moe_sort_pairs, moe_permute, moe_source_rows and moe_combine, back to back (the same bits); launches:
// the ops this takes; routers in copies beyond the L2 (each layer has its own).
void bm_routing(benchmark::State &state) {
    if (!gpu_present()) {
        state.SkipWithError("no CUDA device");
        return;
    }
    constexpr int64_t kExperts = 128;
    constexpr int64_t kTopK = 8;
    constexpr int64_t kD = 4096;
    const int64_t tokens = state.range(0);
    const bool fused = state.range(1) != 0;
    const int64_t pairs = tokens * kTopK;
    DeviceBlock tickets(static_cast<size_t>(cuda::kRouteTickets * 4), false);
    cudaMemset(tickets.ptr, 0, static_cast<size_t>(cuda::kRouteTickets * 4));
    const auto routers = rotating_weights(static_cast<size_t>(kExperts * kD * 4));  // bf16 patterns read as f32
    const auto x = random_activations(tokens * kD, 11);
    const auto bias = random_activations(kExperts, 12);
    const auto expert_out = random_activations(pairs * kD, 13);
    const auto shared = random_activations(tokens * kD, 14);
    DeviceBlock logits(static_cast<size_t>(tokens * kExperts * 4), false),
        weights(static_cast<size_t>(pairs * 4), false);
    DeviceBlock ids(static_cast<size_t>(pairs * 4), false), offsets(static_cast<size_t>((kExperts + 1) * 4), false);
    DeviceBlock sorted(static_cast<size_t>(pairs * 4), false), row_of(static_cast<size_t>(pairs * 4), false);
    DeviceBlock src(static_cast<size_t>(pairs * 4), false), x_own(static_cast<size_t>(pairs * kD * 4), false);
    DeviceBlock out(static_cast<size_t>(tokens * kD * 4), false);
    cuda::CudaMatrix m = dense_matrix(DType::kF32, kExperts, kD, cuda::ActRounding::kNone);
    const auto f = [](const DeviceBlock &b) { return static_cast<float *>(b.ptr); };
    const auto i = [](const DeviceBlock &b) { return static_cast<int32_t *>(b.ptr); };
    const auto *xp = static_cast<const float *>(x->ptr);
    size_t turn = 0;
    const auto launch = [&] {
        m.data = routers[turn++ % routers.size()]->ptr;
        cudaError_t e = cudaSuccess;
        if (fused) {
            e = cuda::moe_route(
                m, xp, tokens, f(*bias), kTopK, true, 3.0f, 1, pairs,
                cuda::MoeRouteBuffers{f(logits), i(ids), f(weights), i(offsets), i(sorted), i(row_of), i(src)},
                i(tickets), nullptr, nullptr);
        } else {
            e = cuda::cuda_matmul(m, xp, tokens, f(logits), nullptr);
            if (e == cudaSuccess) {
                e = cuda::router_topk(f(logits), f(*bias), tokens, kExperts, kTopK, true, 3.0f, i(ids), f(weights),
                                      nullptr);
            }
            if (e == cudaSuccess) {
                e = cuda::moe_sort_pairs(i(ids), tokens, kTopK, kExperts, i(offsets), i(sorted), i(row_of), nullptr,
                                         nullptr);
            }
        }
        if (e == cudaSuccess) {
            e = cuda::moe_permute(xp, tokens, kD, i(sorted), i(offsets), kExperts, 0, kExperts, kTopK, f(x_own), pairs,
                                  nullptr, nullptr);
        }
        if (!fused && e == cudaSuccess) {
            e = cuda::moe_source_rows(i(ids), i(row_of), pairs, i(offsets), kExperts, 1, pairs, i(src), nullptr,
                                      nullptr);
        }
        if (e == cudaSuccess) {
            e = cuda::moe_combine(xp, f(*expert_out), pairs, i(src), f(weights), f(*shared), tokens, kTopK, kD, f(out),
                                  nullptr, nullptr);
        }
        if (e != cudaSuccess) std::fprintf(stderr, "routing: %s\n", cudaGetErrorString(e));
    };
    state.counters["us"] = time_state(state, launch, 20) * 1e6;
    state.counters["launches"] = fused ? 3 : 6;
}

// args: rows, d. add_rms_norm's h = x + r and y = rms_norm(h).
void bm_add_rms_norm(benchmark::State &state) {
    if (!gpu_present()) {
        state.SkipWithError("no CUDA device");
        return;
    }
    const int64_t rows = state.range(0);
    const int64_t d = state.range(1);
    const auto n = static_cast<size_t>(rows * d * 4);
    DeviceBlock x(n, false), r(n, false), h(n, false), y(n, false), w(static_cast<size_t>(d * 2), true);
    cudaMemset(x.ptr, 0, n);
    cudaMemset(r.ptr, 0, n);
    const auto launch = [&] {
        cuda::add_rms_norm(static_cast<const float *>(x.ptr), static_cast<const float *>(r.ptr), rows, d,
                           DType::kBF16, w.ptr, 1e-5f, static_cast<float *>(h.ptr), static_cast<float *>(y.ptr),
                           nullptr);
    };
    state.counters["us"] = time_state(state, launch, 50) * 1e6;
}

// The sampling op over rows of E128's 128896 logits. shape 0: uniform in [-2, 2), with a temperature every id within
// the relevant gap of the top one (the sampler's worst case: every key bucketed, sorted where the filters read them
// all); shape 1: a trained model's shape, normal(-4, 2.5) under 40 peaks at 12 to 14. mode 0: greedy; 1: T 0.7,
// top-p 0.9; 2: the CLI's defaults (T 0.8, top-k 40, top-p 0.95, min-p 0.05); 3: the OpenAI API's (T 1, no filter);
// 4: T 0.7 with top-k one short of the vocabulary (every key sorted, no sums).
void bm_sample(benchmark::State &state) {
    if (!gpu_present()) {
        state.SkipWithError("no CUDA device");
        return;
    }
    constexpr int32_t kVocab = 128896;
    const int64_t n_rows = state.range(0);
    const int64_t mode = state.range(1);
    std::vector<float> hl(static_cast<size_t>(n_rows * kVocab));
    std::mt19937 rng(21);
    if (state.range(2) == 0) {
        std::uniform_real_distribution<float> u(-2.0f, 2.0f);
        for (float &v : hl) v = u(rng);
    } else {
        std::normal_distribution<float> lm(-4.0f, 2.5f);
        for (float &v : hl) v = lm(rng);
        for (int64_t k = 0; k < 40 * n_rows; ++k) hl[rng() % hl.size()] = 12.0f + 0.05f * static_cast<float>(k % 40);
    }
    const auto logits = device_copy(hl);
    std::vector<SampleRow> rows(static_cast<size_t>(n_rows));
    for (int64_t i = 0; i < n_rows; ++i) {
        SampleRow &r = rows[static_cast<size_t>(i)];
        r.params = SamplingParams{};
        if (mode != 2) {
            r.params.temperature = mode == 0 ? 0.0f : (mode == 3 ? 1.0f : 0.7f);
            r.params.top_k = mode == 4 ? kVocab - 1 : 0;
            r.params.top_p = mode == 1 ? 0.9f : 1.0f;
            r.params.min_p = 0.0f;
        }
        r.position = 4096 + i;
        r.logit_row = static_cast<int32_t>(i);
    }
    const auto d_rows = device_copy(rows);
    const int64_t ws_bytes = cuda::sample_workspace_bytes(kVocab, n_rows);
    DeviceBlock ws(static_cast<size_t>(ws_bytes), false),
        out(static_cast<size_t>(n_rows) * sizeof(SampledToken), false);
    const auto launch = [&] {
        const cudaError_t e =
            cuda::sample(static_cast<const float *>(logits->ptr), n_rows, kVocab, kVocab,
                         static_cast<const SampleRow *>(d_rows->ptr), n_rows, nullptr, 0, nullptr, 0,
                         static_cast<SampledToken *>(out.ptr), ws.ptr, ws_bytes, kVocab, nullptr, nullptr);
        if (e != cudaSuccess) std::fprintf(stderr, "sample: %s\n", cudaGetErrorString(e));
    };
    state.counters["us"] = time_state(state, launch, 20) * 1e6;
}

void product_args(benchmark::internal::Benchmark *b) {
    b->ArgNames({"rows", "K", "tokens", "canonical"});
    for (const int64_t tokens : {1, 8, 64, 512}) {
        for (const auto &[rows, k] : {std::pair<int64_t, int64_t>{4096, 4096}, {11264, 4096}, {128896, 4096}}) {
            b->Args({rows, k, tokens, 0});
        }
        b->Args({4096, 12288, tokens, 1});
    }
}

BENCHMARK(bm_bf16_product)->Apply(product_args)->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_bf16_multi)
    ->ArgNames({"set", "fused", "tokens"})
    ->ArgsProduct({{0, 1, 2}, {0, 1}, {1, 8}})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_f32_router)->ArgNames({"experts", "tokens"})->Args({128, 1})->Args({288, 1})->Args({128, 8})
    ->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_e4m3_grouped)->ArgNames({"rows", "K", "experts", "pairs"})->Args({2560, 4096, 8, 8})
    ->Args({4096, 1280, 8, 8})->Args({1280, 4096, 128, 256})->Args({4096, 1280, 128, 256})
    ->Args({1280, 4096, 128, 4096})->Args({4096, 1280, 128, 4096})->UseManualTime()->Iterations(1)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_attention)
    ->ArgNames({"positions", "heads", "window", "split", "q8q5", "batch", "prefill"})
    ->ArgsProduct({{8192}, {64}, {0}, {0, 1, 2, 3}, {0}, {1}, {0}})
    ->Args({8192, 64, 0, 1, 1, 1, 0})
    ->ArgsProduct({{4096}, {96}, {512}, {1, 2, 3}, {0}, {1}, {0}})
    ->Args({4096, 96, 512, 1, 1, 1, 0})
    ->Args({4096, 64, 0, 1, 1, 1, 0})
    ->ArgsProduct({{4096}, {64}, {0}, {1}, {0}, {32, 128}, {0}})
    ->ArgsProduct({{512, 2048, 8192}, {64}, {0}, {0}, {0}, {1}, {1}})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_routing)
    ->ArgNames({"tokens", "fused"})
    ->ArgsProduct({{1, 8, 32, 64}, {0, 1}})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_sample)
    ->ArgNames({"rows", "mode", "shape"})
    ->ArgsProduct({{1}, {0, 1, 2, 3, 4}, {0, 1}})
    ->ArgsProduct({{32}, {0, 2}, {1}})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_add_rms_norm)->Args({1, 4096})->Args({64, 4096})->Args({512, 4096})->UseManualTime()->Iterations(1)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace memra

BENCHMARK_MAIN();
