// No allocation on the hot path (ARCHITECTURE.md "Hot-path rules"): this file replaces the global
// operator new of the memra_kv_tests binary with a counting one, then runs begin / stage / read /
// row-bytes / commit / rollback loops and requires a count of zero. A refused call (whose message is
// a heap string) shows the counter sees allocations made inside memra.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "dense_kv_cache.h"
#include "kv_test_util.h"

#include "alloc_counter.h"

namespace memra::kv {
namespace {

TEST(KvCacheHotPath, StageCommitRollbackReadDoNotAllocate) {
    KvCacheSpec spec;
    spec.layers = {{2, 64, 0}, {1, 64, 8}, {2, 32, 0}, {1, 32, 3}};
    spec.k_format = KvFormat::kQ8_0;
    spec.v_format = KvFormat::kQ5_1;
    spec.capacity = 300;
    spec.max_stage_rows = 4;
    auto created = KvCache::create(spec);
    ASSERT_TRUE(created.has_value());
    KvCache &cache = *created;

    // Inputs and outputs sized once, as an engine sizes its workspace at prepare time.
    std::vector<std::vector<float>> k_in, v_in;
    int64_t widest = 0;
    for (int l = 0; l < cache.n_layers(); ++l) {
        const int64_t e = cache.layout(l).row_elems;
        widest = std::max(widest, e);
        k_in.emplace_back();
        v_in.emplace_back();
        for (int r = 0; r < spec.max_stage_rows; ++r) {
            const auto k = test::row_values(l, r, 3, false, e);
            const auto v = test::row_values(l, r, 3, true, e);
            k_in.back().insert(k_in.back().end(), k.begin(), k.end());
            v_in.back().insert(v_in.back().end(), v.begin(), v.end());
        }
    }
    std::vector<float> k_out(static_cast<size_t>(widest * spec.capacity)), v_out(k_out.size());

    const int64_t before = g_allocations.load();
    bool all_ok = true;
    int64_t bytes_seen = 0;
    for (int step = 0; step < 120 && cache.length() + spec.max_stage_rows <= spec.capacity; ++step) {
        auto txn = cache.begin();
        all_ok = all_ok && txn.has_value();
        const int64_t n = 1 + step % spec.max_stage_rows;
        for (int l = 0; l < cache.n_layers(); ++l) {
            const auto e = static_cast<size_t>(cache.layout(l).row_elems);
            const auto k = std::span<const float>(k_in[l]).first(static_cast<size_t>(n) * e);
            const auto v = std::span<const float>(v_in[l]).first(static_cast<size_t>(n) * e);
            all_ok = all_ok && cache.stage(*txn, l, k, v, n).has_value();
            // Attention over everything live, staged rows included.
            const int64_t p0 = cache.live_begin(l);
            const int64_t p1 = cache.live_end(l);
            const auto count = static_cast<size_t>(p1 - p0) * e;
            all_ok = all_ok && cache.read(l, p0, p1, std::span<float>(k_out).first(count),
                                          std::span<float>(v_out).first(count)).has_value();
            auto row = cache.k_row_bytes(l, p1 - 1);
            all_ok = all_ok && row.has_value();
            bytes_seen += row ? static_cast<int64_t>(row->size()) : 0;
        }
        if (step % 3 == 2) {
            all_ok = all_ok && cache.rollback(*txn).has_value();
        } else {
            all_ok = all_ok && cache.commit(*txn, step % 3 == 0 ? n : n / 2).has_value();
        }
    }
    const int64_t hot = g_allocations.load() - before;
    EXPECT_TRUE(all_ok);
    EXPECT_GT(cache.length(), 100);
    EXPECT_GT(bytes_seen, 0);
    EXPECT_EQ(hot, 0) << "allocations on the stage/commit/rollback/read path";

    // The counter is live: a refusal inside memra builds a heap message.
    const int64_t refused_before = g_allocations.load();
    auto t = cache.begin();
    auto nested = cache.begin();
    const int64_t refused = g_allocations.load() - refused_before;
    EXPECT_FALSE(nested.has_value());
    EXPECT_GT(refused, 0);
    ASSERT_TRUE(t.has_value());
    EXPECT_TRUE(cache.rollback(*t).has_value());
}

}  // namespace
}  // namespace memra::kv
