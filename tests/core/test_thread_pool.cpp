// ThreadPool: every index covered exactly once, by contiguous ranges, for any thread count and grain.
#include <atomic>
#include <mutex>
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

TEST(ThreadPoolDeathTest, RefusesZeroThreads) { EXPECT_DEATH(ThreadPool(0), "at least 1 thread"); }

}  // namespace
}  // namespace memra
