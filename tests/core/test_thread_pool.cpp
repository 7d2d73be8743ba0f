// ThreadPool: every index covered exactly once, by contiguous ranges, for any thread count and grain.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/thread_pool.h"

namespace memra {
namespace {

TEST(ThreadPool, CoversEveryIndexOnceWithContiguousRanges) {
    for (int threads : {1, 2, 3, 8}) {
        ThreadPool pool(threads);
        EXPECT_EQ(pool.n_threads(), threads);
        for (int64_t n : {0, 1, 2, 7, 64, 1001}) {
            for (int64_t grain : {1, 4, 100}) {
                std::vector<int> hits(static_cast<size_t>(n), 0);
                std::mutex m;
                std::vector<std::pair<int64_t, int64_t>> ranges;
                pool.parallel_for(
                    n,
                    [&](int64_t b, int64_t e) {
                        for (int64_t i = b; i < e; ++i) ++hits[static_cast<size_t>(i)];
                        std::lock_guard lock(m);
                        ranges.emplace_back(b, e);
                    },
                    grain);
                for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << n << " " << i;
                EXPECT_LE(static_cast<int>(ranges.size()), threads);
                for (auto [b, e] : ranges) {
                    EXPECT_LT(b, e);
                    if (e != n) {
                        EXPECT_GE(e - b, grain);
                    }
                }
            }
        }
    }
}

TEST(ThreadPool, ReusableAcrossManyCalls) {
    ThreadPool pool(4);
    std::atomic<int64_t> sum{0};
    for (int call = 0; call < 500; ++call) {
        pool.parallel_for(100, [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) sum += i;
        });
    }
    EXPECT_EQ(sum.load(), 500 * 4950);
}

// Workers spin briefly after a job and then sleep: jobs that find them awake, asleep, or on their way to
// sleep all run every range exactly once.
TEST(ThreadPool, WakesSleepingWorkersAndCatchesSpinningOnes) {
    ThreadPool pool(3);
    std::atomic<int64_t> sum{0};
    auto add = [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) sum += i;
    };
    int64_t want = 0;
    for (int round = 0; round < 60; ++round) {
        pool.parallel_for(30, add);
        want += 435;
        // 0 us: back to back; around the spin window; well past it (the workers are asleep).
        const int pause_us[] = {0, 50, 100, 150, 2000};
        std::this_thread::sleep_for(std::chrono::microseconds(pause_us[round % 5]));
    }
    EXPECT_EQ(sum.load(), want);
}

// Informational: the cost of one small parallel_for (a decode step makes ~140 of them).
TEST(ThreadPool, MeasuredSmallJobLatency) {
    for (int threads : {2, 4}) {
        ThreadPool pool(threads);
        std::vector<float> v(1024, 1.0f);
        auto job = [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) v[static_cast<size_t>(i)] *= 1.0f;
        };
        for (int i = 0; i < 100; ++i) pool.parallel_for(1024, job);
        constexpr int kCalls = 2000;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < kCalls; ++i) pool.parallel_for(1024, job);
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
        std::printf("[ measured ] parallel_for of 1024 floats, %d threads: %lld ns per call (%u hardware threads)\n",
                    threads, static_cast<long long>(ns.count() / kCalls), std::thread::hardware_concurrency());
        EXPECT_EQ(v[0], 1.0f);
    }
}

TEST(ThreadPoolDeathTest, RefusesZeroThreads) { EXPECT_DEATH(ThreadPool(0), "at least 1 thread"); }

}  // namespace
}  // namespace memra
