// CPU matmul throughput: bf16 and fp8 (128x128 block scales) weights, 4096x4096 (attention / dense
// projection) and 1280x4096 (one expert's gate or up), at 1, 8 and 128 tokens. Reports the weight bytes
// streamed per second beside a memcpy of the same bytes in the same run (the ceiling: memcpy also
// writes them, so a kernel that only reads can pass it), their ratio, and GFLOP/s; all wall-clock.
// GFLOP/s_cpu divides by the process CPU time instead: the rate per busy core, which a shared, loaded
// machine distorts less than wall time.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <random>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "backend/cpu/matmul.h"
#include "core/float_formats.h"
#include "core/fp8_block.h"

namespace memra {
namespace {

using Clock = std::chrono::steady_clock;

// Best-of-5 bytes per second of a memcpy of `bytes` (source and destination faulted in first).
double memcpy_bytes_per_second(size_t bytes) {
    std::vector<uint8_t> src(bytes, 1), dst(bytes, 0);
    std::memcpy(dst.data(), src.data(), bytes);
    double best = 1e30;
    for (int i = 0; i < 5; ++i) {
        const auto t0 = Clock::now();
        std::memcpy(dst.data(), src.data(), bytes);
        benchmark::ClobberMemory();
        best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    benchmark::DoNotOptimize(dst.data());
    return static_cast<double>(bytes) / best;
}

// CPU seconds used by the whole process so far (all threads).
double process_cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Args: fp8 (0 = bf16, 1 = fp8), rows, n_tokens, threads. K = 4096.
void bm_matmul(benchmark::State &state) {
    const bool fp8 = state.range(0) != 0;
    const int64_t rows = state.range(1);
    const int64_t n_tokens = state.range(2);
    const int threads = static_cast<int>(state.range(3));
    constexpr int64_t kCols = 4096;
    const size_t n = static_cast<size_t>(rows * kCols);

    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<float> wf(n);  // [rows, 4096] f32 source values
    for (float &v : wf) v = normal(rng);
    std::vector<uint16_t> w_bf16;  // [rows, 4096] bf16
    std::vector<uint8_t> w_fp8;    // [rows, 4096] e4m3
    std::vector<float> scale;      // [rows/128, 32] f32
    cpu::WeightRef w;
    w.rows = rows;
    w.cols = kCols;
    if (fp8) {
        w_fp8.resize(n);
        scale.resize(static_cast<size_t>(fp8_scale_blocks(rows) * fp8_scale_blocks(kCols)));
        quantize_fp8_block(wf.data(), rows, kCols, w_fp8.data(), scale.data());
        w.dtype = DType::kF8E4M3;
        w.data = w_fp8.data();
        w.scale_inv = scale.data();
    } else {
        w_bf16.resize(n);
        for (size_t i = 0; i < n; ++i) w_bf16[i] = f32_to_bf16(wf[i]);
        w.dtype = DType::kBF16;
        w.data = w_bf16.data();
    }
    std::vector<float> x(static_cast<size_t>(n_tokens * kCols));  // [n_tokens, 4096] f32
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (float &v : x) v = uniform(rng);
    std::vector<float> y(static_cast<size_t>(n_tokens * rows));  // [n_tokens, rows] f32

    const size_t weight_bytes = n * (fp8 ? 1 : 2) + scale.size() * sizeof(float);
    const double ceiling = memcpy_bytes_per_second(weight_bytes);
    ThreadPool pool(threads);
    cpu::matmul(pool, x.data(), n_tokens, w, y.data());  // warm-up: pages and caches
    const auto t0 = Clock::now();
    const double cpu0 = process_cpu_seconds();
    for (auto _ : state) {
        cpu::matmul(pool, x.data(), n_tokens, w, y.data());
        benchmark::DoNotOptimize(y.data());
        benchmark::ClobberMemory();
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const double cpu_seconds = process_cpu_seconds() - cpu0;
    const auto iters = static_cast<double>(state.iterations());
    const double weight_rate = static_cast<double>(weight_bytes) * iters / seconds;
    state.counters["weight_GB/s"] = weight_rate / 1e9;
    state.counters["memcpy_GB/s"] = ceiling / 1e9;
    state.counters["vs_memcpy"] = weight_rate / ceiling;
    const double flops = 2.0 * static_cast<double>(n_tokens * rows * kCols) * iters;
    state.counters["GFLOP/s"] = flops / seconds / 1e9;
    state.counters["GFLOP/s_cpu"] = flops / cpu_seconds / 1e9;
}

void matmul_args(benchmark::internal::Benchmark *b) {
    const int64_t max_threads = std::max(1u, std::thread::hardware_concurrency());
    for (int64_t fp8 : {0, 1}) {
        for (int64_t rows : {4096, 1280}) {
            for (int64_t tokens : {1, 8, 128}) {
                for (int64_t threads : {int64_t{1}, max_threads}) {
                    b->Args({fp8, rows, tokens, threads});
                    if (max_threads == 1) break;
                }
            }
        }
    }
}

BENCHMARK(bm_matmul)
    ->Apply(matmul_args)
    ->ArgNames({"fp8", "rows", "tokens", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace memra

BENCHMARK_MAIN();
