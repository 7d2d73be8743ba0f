// ThreadPool: every index covered exactly once, by contiguous ranges (or claimed grain ranges), for any thread
// count and grain.
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

// One job over [0, n): how often each index ran, and the ranges fn was called with.
struct JobRecord {
    std::vector<int> hits;
    std::vector<std::pair<int64_t, int64_t>> ranges;
};

JobRecord record_job(ThreadPool &pool, int64_t n, int64_t grain, bool dynamic) {
    JobRecord rec;
    rec.hits.assign(static_cast<size_t>(n), 0);
    std::mutex m;
    const auto fn = [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) ++rec.hits[static_cast<size_t>(i)];
        std::lock_guard lock(m);
        rec.ranges.emplace_back(b, e);
    };
    if (dynamic) {
        pool.parallel_for_dynamic(n, fn, grain);
    } else {
        pool.parallel_for(n, fn, grain);
    }
    return rec;
}

TEST(ThreadPool, CoversEveryIndexOnceWithContiguousRanges) {
    for (int threads : {1, 2, 3, 8}) {
        ThreadPool pool(threads);
        EXPECT_EQ(pool.n_threads(), threads);
        for (int64_t n : {0, 1, 2, 7, 64, 1001}) {
            for (int64_t grain : {1, 4, 100}) {
                const auto [hits, ranges] = record_job(pool, n, grain, false);
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

// Dynamic jobs: every index once, in ranges of exactly `grain` (the last may be shorter) that start at multiples
// of it; mixed with static jobs on the same pool; a slow range does not hold the others (another thread takes
// the rest).
TEST(ThreadPool, DynamicJobsCoverEveryIndexOnceInGrainRanges) {
    for (int threads : {1, 2, 3, 8}) {
        ThreadPool pool(threads);
        for (int64_t n : {0, 1, 2, 7, 64, 1001}) {
            for (int64_t grain : {1, 4, 100}) {
                auto [hits, ranges] = record_job(pool, n, grain, true);
                for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << n << " " << i;
                const bool serial = threads == 1 || n <= grain;
                for (auto [b, e] : ranges) {
                    if (serial) {
                        EXPECT_EQ(b, 0);
                        EXPECT_EQ(e, n);
                        continue;
                    }
                    EXPECT_EQ(b % grain, 0);
                    EXPECT_EQ(e, std::min(n, b + grain));
                }
                pool.parallel_for(n, [&](int64_t b, int64_t e) {
                    for (int64_t i = b; i < e; ++i) --hits[static_cast<size_t>(i)];
                });
                for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 0) << n << " " << i;
            }
        }
    }
    ThreadPool pool(2);
    std::atomic<int> by_others{0};
    const auto caller = std::this_thread::get_id();
    pool.parallel_for_dynamic(
        64,
        [&](int64_t b, int64_t) {
            if (b == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
            if (std::this_thread::get_id() != caller) ++by_others;
        },
        1);
    // Whichever thread took index 0 slept; the other one took (nearly) every other index meanwhile.
    EXPECT_GE(by_others.load() >= 32 ? by_others.load() : 64 - by_others.load(), 60);
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
