// Host conversion throughput: bf16 -> f32 over 16 MiB, FP8 block dequantization of a 4096x4096
// matrix and q8_0 dequantization, each reported as memory traffic (bytes read + written) per second,
// beside a memcpy moving the same traffic (the ceiling) and the ratio of the two (vs_memcpy).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "core/float_formats.h"
#include "core/fp8_block.h"
#include "core/quant_blocks.h"

namespace memra {
namespace {

using Clock = std::chrono::steady_clock;

// Best-of-5 rate of a memcpy that reads and writes `traffic` bytes in total.
double memcpy_traffic_per_second(size_t traffic) {
    const size_t n = traffic / 2;
    std::vector<uint8_t> src(n, 1), dst(n, 0);
    std::memcpy(dst.data(), src.data(), n);  // fault the pages in
    double best = 1e30;
    for (int i = 0; i < 5; ++i) {
        const auto t0 = Clock::now();
        std::memcpy(dst.data(), src.data(), n);
        benchmark::ClobberMemory();
        best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    benchmark::DoNotOptimize(dst.data());
    return static_cast<double>(traffic) / best;
}

// Runs `body` under the benchmark loop and reports traffic/s, the memcpy ceiling and their ratio.
void run_with_ceiling(benchmark::State &state, size_t traffic, const std::function<void()> &body) {
    const double ceiling = memcpy_traffic_per_second(traffic);
    const auto t0 = Clock::now();
    for (auto _ : state) {
        body();
        benchmark::ClobberMemory();
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const double rate = static_cast<double>(traffic) * static_cast<double>(state.iterations()) / seconds;
    state.SetBytesProcessed(static_cast<int64_t>(traffic) * state.iterations());
    state.counters["memcpy_B/s"] = benchmark::Counter(ceiling, benchmark::Counter::kDefaults,
                                                      benchmark::Counter::OneK::kIs1024);
    state.counters["vs_memcpy"] = rate / ceiling;
}

void bm_bf16_to_f32(benchmark::State &state) {
    const size_t n = (16u << 20) / 2;  // 16 MiB of bf16
    std::vector<uint16_t> in(n);       // [n] bf16
    std::mt19937 rng(1);
    for (auto &v : in) v = static_cast<uint16_t>(rng());
    std::vector<float> out(n);  // [n] f32
    run_with_ceiling(state, n * 2 + n * 4, [&] {
        for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
        benchmark::DoNotOptimize(out.data());
    });
}

void bm_fp8_block_dequant(benchmark::State &state) {
    constexpr int64_t kRows = 4096;
    constexpr int64_t kCols = 4096;
    std::vector<uint8_t> q(kRows * kCols);  // [4096, 4096] e4m3
    std::mt19937 rng(2);
    for (auto &v : q) v = static_cast<uint8_t>(rng() & 0x7e);
    std::vector<float> scale(fp8_scale_blocks(kRows) * fp8_scale_blocks(kCols), 0.01f);  // [32, 32]
    std::vector<float> out(kRows * kCols);                                                 // [4096, 4096] f32
    const size_t traffic = q.size() + scale.size() * 4 + out.size() * 4;
    run_with_ceiling(state, traffic, [&] {
        dequantize_fp8_block(q.data(), kRows, kCols, scale.data(), out.data());
        benchmark::DoNotOptimize(out.data());
    });
}

void bm_q8_0_dequant(benchmark::State &state) {
    constexpr int64_t kN = int64_t{8} << 20;  // values
    std::vector<float> x(kN);
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto &v : x) v = normal(rng);
    std::vector<BlockQ8_0> blocks(kN / kQuantBlock);  // [kN / 32] q8_0
    quantize_row_q8_0(x.data(), blocks.data(), kN);
    std::vector<float> out(kN);  // [kN] f32
    const size_t traffic = blocks.size() * sizeof(BlockQ8_0) + out.size() * 4;
    run_with_ceiling(state, traffic, [&] {
        dequantize_row_q8_0(blocks.data(), out.data(), kN);
        benchmark::DoNotOptimize(out.data());
    });
}

// The ceilings alone, as their own rows: memcpy of each benchmark's traffic.
void bm_memcpy(benchmark::State &state) {
    const auto traffic = static_cast<size_t>(state.range(0));
    std::vector<uint8_t> src(traffic / 2, 1), dst(traffic / 2, 0);
    for (auto _ : state) {
        std::memcpy(dst.data(), src.data(), src.size());
        benchmark::ClobberMemory();
    }
    benchmark::DoNotOptimize(dst.data());
    state.SetBytesProcessed(static_cast<int64_t>(traffic) * state.iterations());
}

BENCHMARK(bm_bf16_to_f32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_memcpy)->Arg((16 << 20) + (32 << 20))->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_fp8_block_dequant)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_memcpy)->Arg((16 << 20) + (64 << 20) + 4096)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_q8_0_dequant)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_memcpy)->Arg((8 << 20) / 32 * 34 + (32 << 20))->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace memra

BENCHMARK_MAIN();
