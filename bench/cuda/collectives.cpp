// The collective the TP ranks' exchanges use, memra's all-gather (cuda::NcclCommunicator), against NCCL's own
// all-reduce of the same bytes, which memra never uses (a reduction adds in NCCL's order, not the canonical one:
// DETERMINISM.md rule 2): issue 16's "all-gather latency per message size next to the all-reduce". For every
// rank count 1, 2, 4, 8 the machine has GPUs for, and per-rank messages of 4 KiB to 16 MiB: one thread per rank
// (each on its GPU and stream) makes kCalls calls back to back after kWarmup, between two barriers; the time is
// the slowest rank's, from the first barrier until its stream is done, per call. The all-reduce runs over n times
// the per-rank bytes, the size of the all-gather's result; NCCL's own all-gather on the same blocking
// communicators shows what memra's non-blocking wrapper (its polls, its argument checks) adds. Prints a markdown
// table.
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstddef>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#ifdef MEMRA_HAVE_NCCL
#include <nccl.h>

#include "backend/cuda/nccl_comm.h"
#endif

namespace {

#ifdef MEMRA_HAVE_NCCL
constexpr int kWarmup = 20;
constexpr int kCalls = 200;
constexpr size_t kMaxMessage = size_t{16} << 20;  // per rank

bool cuda_ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    std::fprintf(stderr, "error: %s: %s\n", what, cudaGetErrorString(e));
    return false;
}

// One rank's GPU buffers and stream.
struct RankBuffers {
    int device = 0;
    cudaStream_t stream = nullptr;
    std::byte *send = nullptr;  // [bytes]
    std::byte *recv = nullptr;  // [n * bytes]: the all-gather's result, also the all-reduce's buffer
};

// Microseconds per call of `op(rank)` on n ranks at once (the slowest rank's), or a negative value on an error.
template <class Op>
double time_calls(std::vector<RankBuffers> &ranks, Op op) {
    const int n = static_cast<int>(ranks.size());
    std::barrier sync(n);
    std::vector<double> us(static_cast<size_t>(n), -1.0);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            RankBuffers &b = ranks[static_cast<size_t>(r)];
            bool ok = cuda_ok(cudaSetDevice(b.device), "cudaSetDevice");
            for (int i = 0; i < kWarmup && ok; ++i) ok = op(r);
            ok = ok && cuda_ok(cudaStreamSynchronize(b.stream), "warm-up");
            sync.arrive_and_wait();
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < kCalls && ok; ++i) ok = op(r);
            ok = ok && cuda_ok(cudaStreamSynchronize(b.stream), "timed calls");
            const auto t1 = std::chrono::steady_clock::now();
            sync.arrive_and_wait();
            if (ok) us[static_cast<size_t>(r)] = std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls;
        });
    }
    for (std::thread &t : threads) t.join();
    double worst = 0.0;
    for (double u : us) {
        if (u < 0.0) return -1.0;
        worst = std::max(worst, u);
    }
    return worst;
}

// The rows of every message size on the ranks' buffers (memra's group and NCCL's own communicators live here,
// so both are gone before the streams and buffers).
bool measure_sizes(std::vector<RankBuffers> &ranks, const std::vector<int> &devices,
                   const std::vector<cudaStream_t> &streams) {
    const int n = static_cast<int>(ranks.size());
    constexpr size_t kMaxBytes = kMaxMessage;
    auto group = memra::cuda::NcclGroup::create(devices, streams);
    if (!group) {
        std::fprintf(stderr, "error: %s\n", group.error().message.c_str());
        return false;
    }
    // NCCL's own communicators for the all-reduce (blocking ones: the reference, not memra's path).
    std::vector<ncclComm_t> raw(static_cast<size_t>(n));
    if (ncclCommInitAll(raw.data(), n, devices.data()) != ncclSuccess) {
        std::fprintf(stderr, "error: ncclCommInitAll failed\n");
        return false;
    }
    bool ok = true;
    for (size_t bytes = size_t{4} << 10; bytes <= kMaxBytes && ok; bytes *= 16) {
        const double gather = time_calls(ranks, [&](int r) {
            RankBuffers &b = ranks[static_cast<size_t>(r)];
            auto done = group->communicator(r).all_gather(std::span<const std::byte>(b.send, bytes),
                                                          std::span<std::byte>(b.recv, bytes * static_cast<size_t>(n)));
            if (!done) std::fprintf(stderr, "error: %s\n", done.error().message.c_str());
            return done.has_value();
        });
        const double raw_gather = time_calls(ranks, [&](int r) {
            RankBuffers &b = ranks[static_cast<size_t>(r)];
            return ncclAllGather(b.send, b.recv, bytes, ncclUint8, raw[static_cast<size_t>(r)], b.stream) == ncclSuccess;
        });
        const double reduce = time_calls(ranks, [&](int r) {
            RankBuffers &b = ranks[static_cast<size_t>(r)];
            const size_t floats = bytes * static_cast<size_t>(n) / sizeof(float);
            return ncclAllReduce(b.recv, b.recv, floats, ncclFloat, ncclSum, raw[static_cast<size_t>(r)], b.stream) ==
                   ncclSuccess;
        });
        ok = gather >= 0.0 && raw_gather >= 0.0 && reduce >= 0.0;
        if (ok) {
            std::printf("| %d | %zu KiB | %.1f | %.1f | %zu KiB | %.1f | %.2f |\n", n, bytes >> 10, gather, raw_gather,
                        (bytes * static_cast<size_t>(n)) >> 10, reduce, gather / reduce);
        }
    }
    for (ncclComm_t c : raw) ncclCommDestroy(c);
    return ok;
}

// The table's rows for n ranks (GPUs 0 .. n - 1); false on an error.
bool measure(int n) {
    std::vector<int> devices;
    std::vector<cudaStream_t> streams;
    std::vector<RankBuffers> ranks(static_cast<size_t>(n));
    constexpr size_t kMaxBytes = kMaxMessage;
    for (int r = 0; r < n; ++r) {
        RankBuffers &b = ranks[static_cast<size_t>(r)];
        b.device = r;
        if (!cuda_ok(cudaSetDevice(r), "cudaSetDevice") || !cuda_ok(cudaStreamCreate(&b.stream), "cudaStreamCreate") ||
            !cuda_ok(cudaMalloc(&b.send, kMaxBytes), "cudaMalloc") ||
            !cuda_ok(cudaMalloc(&b.recv, kMaxBytes * static_cast<size_t>(n)), "cudaMalloc") ||
            !cuda_ok(cudaMemset(b.send, 1, kMaxBytes), "cudaMemset")) {
            return false;
        }
        devices.push_back(r);
        streams.push_back(b.stream);
    }
    const bool ok = measure_sizes(ranks, devices, streams);
    for (RankBuffers &b : ranks) {
        cudaSetDevice(b.device);
        cudaFree(b.send);
        cudaFree(b.recv);
        cudaStreamDestroy(b.stream);
    }
    return ok;
}
#endif

}  // namespace

int main() {
#ifdef MEMRA_HAVE_NCCL
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
        std::printf("no GPU: nothing measured\n");
        return 0;
    }
    std::printf("| ranks | all_gather per rank | memra us per call | NCCL ncclAllGather us | all_reduce of | NCCL "
                "ncclAllReduce us | memra gather / reduce |\n");
    std::printf("| -: | -: | -: | -: | -: | -: | -: |\n");
    for (int n = 1; n <= gpus && n <= 8; n *= 2) {
        if (!measure(n)) return 1;
    }
    return 0;
#else
    std::printf("built without NCCL: nothing measured\n");
    return 0;
#endif
}
