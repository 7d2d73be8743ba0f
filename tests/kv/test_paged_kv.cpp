// kv/paged_kv.h: the paged bookkeeping's contract, and SERVING.md 6.4's T2 transaction fuzz. PagePool: lowest
// page first, reference counts, the release of a free page dies. SeqKv: begin / commit / rollback per stream,
// every refusal (its exact message; nothing changed, no page kept), the pages given back at commit (those
// holding no kept row; sliding pages wholly out of every stream's window, MTP streams holding that back),
// release_all, and the page accounting after every call. The T2 fuzz runs random transactions on sequences
// sharing two pools side by side with the dense oracle (dense_kv_cache.h), writing the rows into byte pools
// laid out as core/kv_page.h says, and after every operation checks the accounting and compares the live rows'
// bytes (the touched sequence's every time, every sequence's every 64 operations); MTP streams, which the
// oracle does not have, get a bookkeeping fuzz of their own.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/kv_format.h"
#include "core/kv_page.h"
#include "dense_kv_cache.h"
#include "kv/paged_kv.h"
#include "kv_test_util.h"

namespace memra::kv {
namespace {

using test::row_values;
using test::splitmix64;

constexpr int64_t kPage = kKvPageRows;

struct Pools {
    PagePool full;
    PagePool swa;
    PagePool &of(PoolKind kind) { return kind == PoolKind::kFull ? full : swa; }
};

SeqKvShape make_shape(int n_streams, bool trunk_full, bool trunk_sliding, int64_t window, int64_t max_positions) {
    SeqKvShape s;
    s.n_streams = n_streams;
    s.trunk_full = trunk_full;
    s.trunk_sliding = trunk_sliding;
    s.window = window;
    s.max_positions = max_positions;
    return s;
}

Result<TxnId> begin(SeqKv &seq, Pools &pools, std::initializer_list<int64_t> rows) {
    return seq.begin(std::span<const int64_t>(rows.begin(), rows.size()), pools.full, pools.swa);
}

Result<void> commit(SeqKv &seq, Pools &pools, const TxnId &txn, std::initializer_list<int64_t> keep) {
    return seq.commit(txn, std::span<const int64_t>(keep.begin(), keep.size()), pools.full, pools.swa);
}

// ---- What the bookkeeping must look like ----------------------------------------------------------------

// The pools a stream's rows take pages from (paged_kv.h): the trunk the full pool when it has full layers and
// the sliding pool when it has sliding layers; every MTP stream the sliding pool.
bool stream_uses(const SeqKvShape &shape, PoolKind kind, int stream) {
    if (kind == PoolKind::kFull) return stream == 0 && shape.trunk_full;
    return stream > 0 || shape.trunk_sliding;
}

// Sliding blocks [0, line) are released: the next row of stream s reads positions from length(s) - window + 1,
// so every block ending at or below min_s length(s) - window + 1 is dead. Lengths change only at commit, which
// is where the release happens, so the line follows from the lengths alone.
int64_t release_line(const SeqKv &seq) {
    const SeqKvShape &shape = seq.shape();
    std::optional<int64_t> frontier;
    for (int s = 0; s < shape.n_streams; ++s) {
        if (stream_uses(shape, PoolKind::kSwa, s)) frontier = std::min(frontier.value_or(seq.length(s)), seq.length(s));
    }
    if (!frontier) return 0;
    return std::max<int64_t>(0, *frontier - shape.window + 1) / kPage;
}

// Whether block b of a pool must have a page: it holds a row (committed or staged) of a stream using the pool,
// and, in the sliding pool, lies at or above the release line. This is exact: a page holding no row is a leak,
// a missing page a lost row. It implies that every row a query of the open transaction (or of the next one,
// after a rollback) may read has its page: positions from length(s) - window + 1 on.
bool block_needs_page(const SeqKv &seq, PoolKind kind, int64_t b) {
    const SeqKvShape &shape = seq.shape();
    if (kind == PoolKind::kSwa && b < release_line(seq)) return false;
    for (int s = 0; s < shape.n_streams; ++s) {
        if (!stream_uses(shape, kind, s)) continue;
        const int64_t lo = seq.first(s);
        const int64_t hi = seq.length(s) + seq.staged(s);
        if (hi > lo && lo < (b + 1) * kPage && hi > b * kPage) return true;
    }
    return false;
}

// "" when the sequence's block tables hold exactly the pages block_needs_page says and pages_held counts them.
std::string seq_error(const SeqKv &seq) {
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        const std::span<const int32_t> table = seq.block_table(kind);
        if (static_cast<int64_t>(table.size()) != seq.shape().max_blocks()) {
            return fmt::format("{} block table has {} entries, expected {}", pool_kind_name(kind), table.size(),
                               seq.shape().max_blocks());
        }
        int64_t held = 0;
        for (size_t b = 0; b < table.size(); ++b) {
            const bool has = table[b] >= 0;
            held += has ? 1 : 0;
            if (table[b] < -1) return fmt::format("{} block {} holds {}", pool_kind_name(kind), b, table[b]);
            if (has != block_needs_page(seq, kind, static_cast<int64_t>(b))) {
                std::string streams;
                for (int s = 0; s < seq.shape().n_streams; ++s) {
                    streams += fmt::format(" [{}, {}) + {} staged;", seq.first(s), seq.length(s), seq.staged(s));
                }
                return fmt::format("{} block {}: expected {}, found {} (window {}, release line {}, streams{})",
                                   pool_kind_name(kind), b, has ? "no page" : "a page",
                                   has ? fmt::format("page {}", table[b]) : std::string("none"), seq.shape().window,
                                   release_line(seq), streams);
            }
        }
        if (held != seq.pages_held(kind)) {
            return fmt::format("{} pages_held {}, the block table holds {}", pool_kind_name(kind), seq.pages_held(kind),
                               held);
        }
    }
    return "";
}

// "" when the pools' accounting is exact over the live sequences: per pool, the pages held plus the free pages
// make the pool; every page's refcount is the number of block-table entries holding it; no page is in two
// sequences; and each sequence's tables are what its lengths say (seq_error).
std::string accounting_error(std::span<const SeqKv *const> seqs, const PagePool &full, const PagePool &swa) {
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        const PagePool &pool = kind == PoolKind::kFull ? full : swa;
        std::vector<int32_t> count(static_cast<size_t>(pool.n_pages()), 0);
        std::vector<int> owner(static_cast<size_t>(pool.n_pages()), -1);
        int64_t held = 0;
        for (size_t i = 0; i < seqs.size(); ++i) {
            held += seqs[i]->pages_held(kind);
            for (const int32_t page : seqs[i]->block_table(kind)) {
                if (page < 0) continue;
                if (page >= pool.n_pages()) {
                    return fmt::format("sequence {} holds {} page {}, past the pool's {}", i, pool_kind_name(kind),
                                       page, pool.n_pages());
                }
                const auto p = static_cast<size_t>(page);
                if (owner[p] >= 0 && owner[p] != static_cast<int>(i)) {
                    return fmt::format("{} page {} is held by sequences {} and {}", pool_kind_name(kind), page,
                                       owner[p], i);
                }
                owner[p] = static_cast<int>(i);
                ++count[p];
            }
        }
        if (held + pool.n_free() != pool.n_pages()) {
            return fmt::format("{} pool: {} pages held + {} free != {} pages", pool_kind_name(kind), held,
                               pool.n_free(), pool.n_pages());
        }
        for (int32_t page = 0; page < pool.n_pages(); ++page) {
            if (pool.refcount(page) != count[static_cast<size_t>(page)]) {
                return fmt::format("{} page {}: refcount {}, held by {} block-table entries", pool_kind_name(kind),
                                   page, pool.refcount(page), count[static_cast<size_t>(page)]);
            }
        }
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
        if (std::string e = seq_error(*seqs[i]); !e.empty()) return fmt::format("sequence {}: {}", i, e);
    }
    return "";
}

::testing::AssertionResult accounting_ok(std::initializer_list<const SeqKv *> seqs, const Pools &pools) {
    const std::string e =
        accounting_error(std::span<const SeqKv *const>(seqs.begin(), seqs.size()), pools.full, pools.swa);
    if (e.empty()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << e;
}

// Everything observable of a sequence and its pools: a refused call must leave it as it was.
struct Observed {
    std::vector<int32_t> full_table, swa_table, full_refs, swa_refs;
    std::vector<int64_t> length, staged;
    int64_t full_held = 0, swa_held = 0;
    int32_t full_free = 0, swa_free = 0;
    bool in_txn = false;
    uint64_t generation = 0;

    friend bool operator==(const Observed &, const Observed &) = default;
};

Observed observe(const SeqKv &seq, const Pools &pools) {
    Observed o;
    const auto table = [&](PoolKind kind) {
        const std::span<const int32_t> t = seq.block_table(kind);
        return std::vector<int32_t>(t.begin(), t.end());
    };
    const auto refs = [](const PagePool &pool) {
        std::vector<int32_t> r;
        for (int32_t p = 0; p < pool.n_pages(); ++p) r.push_back(pool.refcount(p));
        return r;
    };
    o.full_table = table(PoolKind::kFull);
    o.swa_table = table(PoolKind::kSwa);
    o.full_refs = refs(pools.full);
    o.swa_refs = refs(pools.swa);
    for (int s = 0; s < seq.shape().n_streams; ++s) {
        o.length.push_back(seq.length(s));
        o.staged.push_back(seq.staged(s));
    }
    o.full_held = seq.pages_held(PoolKind::kFull);
    o.swa_held = seq.pages_held(PoolKind::kSwa);
    o.full_free = pools.full.n_free();
    o.swa_free = pools.swa.n_free();
    o.in_txn = seq.in_txn();
    o.generation = seq.last_generation();
    return o;
}

template <class T>
void expect_refused(const Result<T> &r, const std::string &message) {
    ASSERT_FALSE(r.has_value()) << "expected the refusal: " << message;
    EXPECT_EQ(r.error().message, message);
}

// ---- PagePool ---------------------------------------------------------------------------------------------

TEST(PagePool, HandsOutTheLowestFreePageFirst) {
    PagePool pool(5);
    EXPECT_EQ(pool.n_pages(), 5);
    EXPECT_EQ(pool.n_free(), 5);
    for (int32_t want = 0; want < 5; ++want) EXPECT_EQ(pool.alloc(), want);
    EXPECT_FALSE(pool.alloc().has_value());
    pool.release(3);
    pool.release(1);
    pool.release(4);
    EXPECT_EQ(pool.n_free(), 3);
    EXPECT_EQ(pool.alloc(), 1);  // not the most recently released
    EXPECT_EQ(pool.alloc(), 3);
    pool.release(0);
    EXPECT_EQ(pool.alloc(), 0);
    EXPECT_EQ(pool.alloc(), 4);
    EXPECT_FALSE(pool.alloc().has_value());

    EXPECT_EQ(PagePool(0).n_pages(), 0);
    EXPECT_FALSE(PagePool(0).alloc().has_value());
    EXPECT_FALSE(PagePool().alloc().has_value());
}

TEST(PagePool, SameCallsGiveTheSamePageIds) {
    // Two pools driven by the same random calls hand out the same ids, and every id is the lowest free page.
    const auto run = [](uint64_t seed) {
        PagePool pool(37);
        std::mt19937_64 rng(seed);
        std::vector<int32_t> held, ids;
        for (int i = 0; i < 2000; ++i) {
            if (held.empty() || (rng() % 3 != 0 && pool.n_free() > 0)) {
                int32_t lowest = 0;
                while (pool.refcount(lowest) != 0) ++lowest;
                const std::optional<int32_t> page = pool.alloc();
                EXPECT_EQ(page, lowest);
                if (!page) break;
                held.push_back(*page);
                ids.push_back(*page);
            } else {
                const size_t k = rng() % held.size();
                pool.release(held[k]);
                held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
            }
            EXPECT_EQ(pool.n_free() + static_cast<int32_t>(held.size()), pool.n_pages());
        }
        return ids;
    };
    EXPECT_EQ(run(7), run(7));
    EXPECT_NE(run(7), run(8));
}

TEST(PagePool, RefcountsFollowAllocAndRelease) {
    PagePool pool(4);
    for (int32_t p = 0; p < 4; ++p) EXPECT_EQ(pool.refcount(p), 0);
    ASSERT_EQ(pool.alloc(), 0);
    ASSERT_EQ(pool.alloc(), 1);
    EXPECT_EQ(pool.refcount(0), 1);
    EXPECT_EQ(pool.refcount(1), 1);
    EXPECT_EQ(pool.refcount(2), 0);
    EXPECT_EQ(pool.n_free(), 2);
    pool.release(0);
    EXPECT_EQ(pool.refcount(0), 0);
    EXPECT_EQ(pool.refcount(1), 1);
    EXPECT_EQ(pool.n_free(), 3);
}

TEST(PagePoolDeathTest, ReleaseOfAFreePageDies) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    PagePool pool(4);
    EXPECT_DEATH(pool.release(2), "release of page 2, which no table holds");
    ASSERT_EQ(pool.alloc(), 0);
    pool.release(0);
    EXPECT_DEATH(pool.release(0), "release of page 0, which no table holds");  // a double release
    EXPECT_DEATH(pool.release(4), "page 4 of a pool of 4");
    EXPECT_DEATH(pool.release(-1), "page -1 of a pool of 4");
    EXPECT_DEATH((void)pool.refcount(9), "page 9 of a pool of 4");
}

// ---- SeqKv: transactions ------------------------------------------------------------------------------------

TEST(SeqKv, StartsEmptyWithMtpStreamsAtTheirFirstPosition) {
    const SeqKv seq(make_shape(4, true, true, 512, 1000));
    EXPECT_EQ(seq.shape().max_blocks(), 16);
    for (int s = 0; s < 4; ++s) {
        EXPECT_EQ(seq.first(s), s == 0 ? 0 : s - 1);
        EXPECT_EQ(seq.length(s), seq.first(s));
        EXPECT_EQ(seq.staged(s), 0);
    }
    EXPECT_FALSE(seq.in_txn());
    EXPECT_EQ(seq.last_generation(), 0u);
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        EXPECT_EQ(seq.pages_held(kind), 0);
        ASSERT_EQ(seq.block_table(kind).size(), 16u);
        for (const int32_t page : seq.block_table(kind)) EXPECT_EQ(page, -1);
        EXPECT_FALSE(seq.has_page(kind, 0));
    }
    EXPECT_STREQ(pool_kind_name(PoolKind::kFull), "full");
    EXPECT_STREQ(pool_kind_name(PoolKind::kSwa), "sliding");
}

TEST(SeqKv, BeginStagesRowsPerStreamAndTakesTheirPages) {
    Pools pools{PagePool(8), PagePool(8)};
    SeqKv seq(make_shape(3, true, true, 512, 1000));
    auto txn = begin(seq, pools, {70, 5, 130});
    ASSERT_TRUE(txn.has_value()) << txn.error().message;
    EXPECT_EQ(txn->generation, 1u);
    EXPECT_TRUE(seq.in_txn());
    EXPECT_EQ(seq.staged(0), 70);
    EXPECT_EQ(seq.staged(1), 5);
    EXPECT_EQ(seq.staged(2), 130);
    for (int s = 0; s < 3; ++s) EXPECT_EQ(seq.length(s), seq.first(s));  // nothing committed yet
    // Full pool: the trunk's positions 0..69, blocks 0 and 1. Sliding pool: the trunk's blocks 0, 1, MTP layer
    // 0's block 0, MTP layer 1's positions 1..130, blocks 0..2: one page per block, whichever streams share it.
    EXPECT_EQ(
        std::vector<int32_t>(seq.block_table(PoolKind::kFull).begin(), seq.block_table(PoolKind::kFull).begin() + 3),
        (std::vector<int32_t>{0, 1, -1}));
    EXPECT_EQ(
        std::vector<int32_t>(seq.block_table(PoolKind::kSwa).begin(), seq.block_table(PoolKind::kSwa).begin() + 4),
        (std::vector<int32_t>{0, 1, 2, -1}));
    EXPECT_EQ(seq.pages_held(PoolKind::kFull), 2);
    EXPECT_EQ(seq.pages_held(PoolKind::kSwa), 3);
    EXPECT_EQ(pools.full.n_free(), 6);
    EXPECT_EQ(pools.swa.n_free(), 5);
    EXPECT_EQ(seq.slot(PoolKind::kFull, 65), 1 * 64 + 1);
    EXPECT_EQ(seq.slot(PoolKind::kSwa, 130), 2 * 64 + 2);
    EXPECT_TRUE(accounting_ok({&seq}, pools));
}

TEST(SeqKv, CommitKeepsItsOwnPrefixPerStream) {
    Pools pools{PagePool(8), PagePool(8)};
    SeqKv seq(make_shape(3, true, true, 512, 1000));
    auto txn = begin(seq, pools, {70, 5, 130});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {64, 5, 63}).has_value());
    EXPECT_FALSE(seq.in_txn());
    EXPECT_EQ(seq.length(0), 64);
    EXPECT_EQ(seq.length(1), 5);
    EXPECT_EQ(seq.length(2), 64);  // first position 1, 63 rows kept
    for (int s = 0; s < 3; ++s) EXPECT_EQ(seq.staged(s), 0);
    // Full block 1 held only dropped rows (64..69): back. Sliding block 1 held the trunk's 64..69 and MTP
    // layer 1's 64..130, all dropped: back; block 2 too.
    EXPECT_EQ(seq.pages_held(PoolKind::kFull), 1);
    EXPECT_EQ(seq.pages_held(PoolKind::kSwa), 1);
    EXPECT_EQ(pools.full.n_free(), 7);
    EXPECT_EQ(pools.swa.n_free(), 7);
    EXPECT_TRUE(accounting_ok({&seq}, pools));

    // The next transaction continues every stream where it stands, and takes the lowest free pages again.
    auto next = begin(seq, pools, {1, 60, 1});
    ASSERT_TRUE(next.has_value());
    EXPECT_EQ(next->generation, 2u);
    EXPECT_EQ(seq.slot(PoolKind::kFull, 64), 1 * 64);
    EXPECT_EQ(seq.slot(PoolKind::kSwa, 64), 1 * 64);  // trunk 64, MTP 1 at 64, MTP 0 at 5..64
    ASSERT_TRUE(commit(seq, pools, *next, {1, 60, 1}).has_value());
    EXPECT_EQ(seq.length(0), 65);
    EXPECT_EQ(seq.length(1), 65);
    EXPECT_EQ(seq.length(2), 65);
    EXPECT_TRUE(accounting_ok({&seq}, pools));
}

TEST(SeqKv, RollbackDropsEverythingStaged) {
    Pools pools{PagePool(8), PagePool(8)};
    SeqKv seq(make_shape(2, true, true, 512, 1000));
    auto txn = begin(seq, pools, {100, 90});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {100, 90}).has_value());
    const Observed before = observe(seq, pools);

    txn = begin(seq, pools, {200, 3});
    ASSERT_TRUE(txn.has_value());
    EXPECT_GT(seq.pages_held(PoolKind::kFull), before.full_held);
    ASSERT_TRUE(seq.rollback(*txn, pools.full, pools.swa).has_value());
    Observed after = observe(seq, pools);
    EXPECT_EQ(after.generation, before.generation + 1);  // generations never repeat
    after.generation = before.generation;
    EXPECT_EQ(after, before);
    EXPECT_TRUE(accounting_ok({&seq}, pools));

    // A transaction that stages nothing is still one.
    txn = begin(seq, pools, {0, 0});
    ASSERT_TRUE(txn.has_value());
    EXPECT_EQ(txn->generation, 3u);
    ASSERT_TRUE(seq.rollback(*txn, pools.full, pools.swa).has_value());
    after = observe(seq, pools);
    after.generation = before.generation;
    EXPECT_EQ(after, before);
}

TEST(SeqKv, RefusalsChangeNothing) {
    Pools pools{PagePool(20), PagePool(20)};
    SeqKv seq(make_shape(2, true, true, 512, 576));
    auto first = begin(seq, pools, {10, 4});
    ASSERT_TRUE(first.has_value());
    ASSERT_TRUE(commit(seq, pools, *first, {10, 4}).has_value());
    const Observed closed = observe(seq, pools);

    // Without an open transaction: finalizing anything, the wrong stream count, rows past max_positions,
    // negative rows. max_positions 576 lets the trunk reach position 575 and no further.
    expect_refused(commit(seq, pools, *first, {0, 0}), "KV commit: no transaction is open");
    expect_refused(seq.rollback(*first, pools.full, pools.swa), "KV rollback: no transaction is open");
    expect_refused(begin(seq, pools, {1}), "KV begin: rows for 1 streams, the sequence has 2");
    expect_refused(begin(seq, pools, {1, 1, 1}), "KV begin: rows for 3 streams, the sequence has 2");
    expect_refused(begin(seq, pools, {567, 0}),
                   "KV begin: stream 0 would reach position 576, past the 576 positions a sequence may hold");
    expect_refused(begin(seq, pools, {0, 573}),
                   "KV begin: stream 1 would reach position 576, past the 576 positions a sequence may hold");
    expect_refused(begin(seq, pools, {-1, 0}), "KV begin: stream 0 stages -1 rows");
    EXPECT_EQ(observe(seq, pools), closed);

    // With one open: a nested begin, a stale generation, keep counts out of range or for the wrong streams.
    auto txn = begin(seq, pools, {566, 5});  // the trunk up to position 575, the last it may hold
    ASSERT_TRUE(txn.has_value()) << txn.error().message;
    const Observed open = observe(seq, pools);
    expect_refused(begin(seq, pools, {1, 1}), "KV begin: a transaction is already open (generation 2)");
    expect_refused(commit(seq, pools, *first, {1, 1}),
                   "KV commit: stale transaction (generation 1, the open one is 2)");
    expect_refused(seq.rollback(TxnId{3}, pools.full, pools.swa),
                   "KV rollback: stale transaction (generation 3, the open one is 2)");
    expect_refused(commit(seq, pools, *txn, {567, 0}), "KV commit: stream 0 keeps 567 rows, staged 566");
    expect_refused(commit(seq, pools, *txn, {1, 6}), "KV commit: stream 1 keeps 6 rows, staged 5");
    expect_refused(commit(seq, pools, *txn, {1, -1}), "KV commit: stream 1 keeps -1 rows, staged 5");
    expect_refused(commit(seq, pools, *txn, {1}), "KV commit: keep counts for 1 streams, the sequence has 2");
    EXPECT_EQ(observe(seq, pools), open);
    EXPECT_TRUE(accounting_ok({&seq}, pools));

    // The transaction still works after its refusals; finalizing it twice does not.
    ASSERT_TRUE(commit(seq, pools, *txn, {566, 5}).has_value());
    EXPECT_EQ(seq.length(0), 576);
    expect_refused(commit(seq, pools, *txn, {0, 0}), "KV commit: no transaction is open");
    expect_refused(begin(seq, pools, {1, 0}),
                   "KV begin: stream 0 would reach position 576, past the 576 positions a sequence may hold");
    EXPECT_TRUE(accounting_ok({&seq}, pools));
}

TEST(SeqKv, PoolOutOfPagesRefusesNamingThePoolAndTheCounts) {
    // Another sequence holds pages of both pools, so free != total.
    Pools pools{PagePool(10), PagePool(5)};
    SeqKv other(make_shape(1, true, true, 512, 1000));
    auto t = begin(other, pools, {130});  // 3 pages of each pool
    ASSERT_TRUE(t.has_value());
    ASSERT_TRUE(commit(other, pools, *t, {130}).has_value());

    // A full-attention trunk and two MTP layers in the sliding pool.
    SeqKv seq(make_shape(3, true, false, 512, 1000));
    t = begin(seq, pools, {10, 10, 9});
    ASSERT_TRUE(t.has_value());
    ASSERT_TRUE(commit(seq, pools, *t, {10, 10, 9}).has_value());  // full page 3, sliding page 3
    ASSERT_EQ(pools.full.n_free(), 6);
    ASSERT_EQ(pools.swa.n_free(), 1);
    const Observed before = observe(seq, pools);

    // The trunk's 10..209 need full blocks 1..3, which fit; MTP layer 0's 10..139 need sliding blocks 1 and 2,
    // which do not: the refusal leaves the full pool's pages where they were.
    expect_refused(begin(seq, pools, {200, 130, 0}),
                   "sliding KV pool out of pages: the step needs 2 more, 1 of 5 are free");
    EXPECT_EQ(observe(seq, pools), before);
    // The trunk's 10..448 need full blocks 1..7.
    expect_refused(begin(seq, pools, {439, 10, 10}),
                   "full KV pool out of pages: the step needs 7 more, 6 of 10 are free");
    EXPECT_EQ(observe(seq, pools), before);
    EXPECT_TRUE(accounting_ok({&other, &seq}, pools));

    // A block staged by several streams is counted once: both MTP layers' 10..69 need sliding block 1, and the
    // one free page is enough; the trunk's 10..399 take the last 6 full pages.
    auto txn = begin(seq, pools, {390, 60, 60});
    ASSERT_TRUE(txn.has_value()) << txn.error().message;
    EXPECT_EQ(pools.full.n_free(), 0);
    EXPECT_EQ(pools.swa.n_free(), 0);
    EXPECT_TRUE(accounting_ok({&other, &seq}, pools));
    expect_refused(begin(other, pools, {63}), "full KV pool out of pages: the step needs 1 more, 0 of 10 are free");
    ASSERT_TRUE(seq.rollback(*txn, pools.full, pools.swa).has_value());
    Observed after = observe(seq, pools);
    after.generation = before.generation;
    EXPECT_EQ(after, before);
}

TEST(SeqKv, PagesHoldingNoKeptRowGoBackAtCommit) {
    Pools pools{PagePool(8), PagePool(8)};
    SeqKv seq(make_shape(1, true, false, 0, 1000));
    auto txn = begin(seq, pools, {130});  // blocks 0, 1, 2
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {64}).has_value());  // 0..63: block 0 only
    EXPECT_EQ(seq.pages_held(PoolKind::kFull), 1);
    EXPECT_EQ(pools.full.n_free(), 7);
    EXPECT_TRUE(accounting_ok({&seq}, pools));

    txn = begin(seq, pools, {1});  // position 64: block 1, the lowest free page again
    ASSERT_TRUE(txn.has_value());
    EXPECT_EQ(seq.slot(PoolKind::kFull, 64), 64);
    ASSERT_TRUE(commit(seq, pools, *txn, {0}).has_value());
    EXPECT_EQ(seq.pages_held(PoolKind::kFull), 1);
    EXPECT_FALSE(seq.has_page(PoolKind::kFull, 64));

    txn = begin(seq, pools, {70});  // 64..133: blocks 1, 2
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {1}).has_value());  // 64 kept: block 1 stays, block 2 goes
    EXPECT_EQ(seq.pages_held(PoolKind::kFull), 2);
    EXPECT_EQ(seq.length(0), 65);
    EXPECT_TRUE(accounting_ok({&seq}, pools));

    // A page held before the transaction stays when nothing is kept: it holds committed rows.
    txn = begin(seq, pools, {10});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {0}).has_value());
    EXPECT_EQ(seq.pages_held(PoolKind::kFull), 2);
    EXPECT_TRUE(accounting_ok({&seq}, pools));
}

TEST(SeqKv, PagesOfMtpStreamsWithoutRowsGoBackAtCommit) {
    // MTP layers 1 and 2 have no row below positions 1 and 2; block 0 holds none of their rows until they
    // commit one, so a commit that keeps nothing gives the sliding page back.
    Pools pools{PagePool(4), PagePool(4)};
    SeqKv seq(make_shape(4, true, true, 512, 1000));
    auto txn = begin(seq, pools, {10, 0, 0, 0});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {0, 0, 0, 0}).has_value());
    EXPECT_EQ(seq.pages_held(PoolKind::kFull), 0);
    EXPECT_EQ(seq.pages_held(PoolKind::kSwa), 0);
    EXPECT_TRUE(accounting_ok({&seq}, pools));

    // Full-attention trunk, MTP rows in the sliding pool: the trunk keeps its rows, the MTP layers none.
    SeqKv mtp(make_shape(3, true, false, 512, 1000));
    txn = begin(mtp, pools, {10, 3, 3});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(mtp, pools, *txn, {10, 0, 0}).has_value());
    EXPECT_EQ(mtp.pages_held(PoolKind::kFull), 1);
    EXPECT_EQ(mtp.pages_held(PoolKind::kSwa), 0);
    EXPECT_TRUE(accounting_ok({&seq, &mtp}, pools));
}

// ---- SeqKv: sliding release ----------------------------------------------------------------------------------

// Commits `rows` trunk rows (one stream) in one transaction.
void advance(SeqKv &seq, Pools &pools, int64_t rows) {
    auto txn = begin(seq, pools, {rows});
    ASSERT_TRUE(txn.has_value()) << txn.error().message;
    ASSERT_TRUE(commit(seq, pools, *txn, {rows}).has_value());
    ASSERT_TRUE(accounting_ok({&seq}, pools));
}

TEST(SeqKv, SlidingPagesLeaveAtCommitAroundWindow512) {
    // Window 512, pages of 64: the next row after length L reads positions L - 511 .. L, so block 0 (0..63) is
    // dead once L - 511 >= 64, i.e. at L = 575, and block 1 at L = 639. Full pages never leave.
    Pools pools{PagePool(20), PagePool(20)};
    SeqKv seq(make_shape(1, true, true, 512, 1000));
    const auto swa_pages = [&] { return seq.pages_held(PoolKind::kSwa); };
    advance(seq, pools, 511);
    EXPECT_EQ(swa_pages(), 8);  // 0..510: blocks 0..7
    advance(seq, pools, 1);     // L = 512
    EXPECT_EQ(swa_pages(), 8);
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 0));
    advance(seq, pools, 62);  // L = 574: block 0 still read by the row at 574 (574 - 511 = 63)
    EXPECT_EQ(swa_pages(), 9);
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 63));

    // Staging past the edge releases nothing, and neither does a rollback or a commit that keeps nothing:
    // sliding pages leave at commit only, once the committed rows moved the window.
    auto txn = begin(seq, pools, {2});  // 574, 575
    ASSERT_TRUE(txn.has_value());
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 0));
    ASSERT_TRUE(seq.rollback(*txn, pools.full, pools.swa).has_value());
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 0));
    txn = begin(seq, pools, {200});
    ASSERT_TRUE(txn.has_value());
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 0));
    ASSERT_TRUE(commit(seq, pools, *txn, {0}).has_value());
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 0));
    EXPECT_EQ(swa_pages(), 9);
    EXPECT_TRUE(accounting_ok({&seq}, pools));

    advance(seq, pools, 1);  // L = 575: block 0 is dead
    EXPECT_FALSE(seq.has_page(PoolKind::kSwa, 0));
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 64));
    EXPECT_EQ(seq.block_table(PoolKind::kSwa)[0], -1);
    EXPECT_EQ(swa_pages(), 8);
    EXPECT_EQ(pools.swa.refcount(0), 0);
    EXPECT_TRUE(seq.has_page(PoolKind::kFull, 0));
    advance(seq, pools, 1);  // L = 576: blocks 1..8
    EXPECT_EQ(swa_pages(), 8);
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 64));

    // After the release a rollback needs no released row: every position 576 - 511 = 65 .. stays readable.
    txn = begin(seq, pools, {100});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(seq.rollback(*txn, pools.full, pools.swa).has_value());
    for (int64_t p = 65; p < 576; ++p) ASSERT_TRUE(seq.has_page(PoolKind::kSwa, p)) << p;

    advance(seq, pools, 62);  // L = 638: block 1 (64..127) still read by the row at 638
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 127));
    advance(seq, pools, 1);  // L = 639
    EXPECT_FALSE(seq.has_page(PoolKind::kSwa, 127));
    EXPECT_EQ(swa_pages(), 8);
    EXPECT_EQ(seq.pages_held(PoolKind::kFull), 10);
}

TEST(SeqKv, SlidingWindowSpanningThreePagesReleasesBlockByBlock) {
    // Window 150 spans 3 pages (and touches a 4th): block b is dead at L = 64 (b + 1) + 149.
    Pools pools{PagePool(20), PagePool(20)};
    SeqKv seq(make_shape(1, false, true, 150, 1000));
    for (int64_t length = 1; length <= 600; ++length) {
        advance(seq, pools, 1);
        ASSERT_EQ(seq.length(0), length);
        const int64_t dead_blocks = std::max<int64_t>(0, length - 149) / 64;
        for (int64_t b = 0; b * 64 < length; ++b) {
            ASSERT_EQ(seq.has_page(PoolKind::kSwa, b * 64), b >= dead_blocks) << "length " << length << " block " << b;
        }
        ASSERT_LE(seq.pages_held(PoolKind::kSwa), 4);
        ASSERT_EQ(seq.pages_held(PoolKind::kFull), 0);
    }
}

TEST(SeqKv, LaggingMtpStreamsHoldBackTheSlidingRelease) {
    Pools pools{PagePool(40), PagePool(40)};
    // The trunk alone would release blocks 0 and 1 at 700 ((700 - 511) / 64 = 2); MTP layer 1 at 574 (its first
    // position 1 plus 573 rows) still reads position 63, so nothing leaves: the release follows the minimum.
    SeqKv seq(make_shape(3, true, true, 512, 1000));
    auto txn = begin(seq, pools, {700, 700, 573});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {700, 700, 573}).has_value());
    EXPECT_EQ(seq.length(2), 574);
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 0));
    EXPECT_EQ(seq.pages_held(PoolKind::kSwa), 11);
    EXPECT_TRUE(accounting_ok({&seq}, pools));
    txn = begin(seq, pools, {1, 1, 1});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {1, 1, 1}).has_value());  // MTP layer 1 at 575
    EXPECT_FALSE(seq.has_page(PoolKind::kSwa, 0));
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 64));
    EXPECT_TRUE(accounting_ok({&seq}, pools));
    txn = begin(seq, pools, {0, 0, 64});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(seq, pools, *txn, {0, 0, 64}).has_value());  // MTP layer 1 at 639: block 1 too
    EXPECT_FALSE(seq.has_page(PoolKind::kSwa, 64));
    EXPECT_TRUE(seq.has_page(PoolKind::kSwa, 128));
    EXPECT_TRUE(accounting_ok({&seq}, pools));

    // A full-attention trunk takes no part: only the MTP stream moves the sliding window.
    SeqKv mtp(make_shape(2, true, false, 512, 1000));
    txn = begin(mtp, pools, {900, 574});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(mtp, pools, *txn, {900, 574}).has_value());
    EXPECT_TRUE(mtp.has_page(PoolKind::kSwa, 0));
    EXPECT_EQ(mtp.pages_held(PoolKind::kSwa), 9);
    EXPECT_EQ(mtp.pages_held(PoolKind::kFull), 15);
    txn = begin(mtp, pools, {0, 1});
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(commit(mtp, pools, *txn, {0, 1}).has_value());
    EXPECT_FALSE(mtp.has_page(PoolKind::kSwa, 0));
    EXPECT_TRUE(accounting_ok({&seq, &mtp}, pools));
}

TEST(SeqKv, ReleaseAllReturnsEveryPage) {
    Pools pools{PagePool(30), PagePool(30)};
    SeqKv a(make_shape(3, true, true, 130, 1000));
    SeqKv b(make_shape(1, true, true, 130, 1000));
    auto ta = begin(a, pools, {300, 290, 280});
    ASSERT_TRUE(ta.has_value());
    ASSERT_TRUE(commit(a, pools, *ta, {300, 290, 280}).has_value());  // some sliding blocks already released
    auto tb = begin(b, pools, {100});
    ASSERT_TRUE(tb.has_value());
    ASSERT_TRUE(commit(b, pools, *tb, {100}).has_value());
    ta = begin(a, pools, {70, 70, 70});  // and a transaction open
    ASSERT_TRUE(ta.has_value());
    EXPECT_TRUE(accounting_ok({&a, &b}, pools));

    a.release_all(pools.full, pools.swa);
    EXPECT_FALSE(a.in_txn());
    for (int s = 0; s < 3; ++s) {
        EXPECT_EQ(a.length(s), a.first(s));
        EXPECT_EQ(a.staged(s), 0);
    }
    EXPECT_EQ(a.pages_held(PoolKind::kFull), 0);
    EXPECT_EQ(a.pages_held(PoolKind::kSwa), 0);
    EXPECT_EQ(pools.full.n_free() + b.pages_held(PoolKind::kFull), 30);
    EXPECT_EQ(pools.swa.n_free() + b.pages_held(PoolKind::kSwa), 30);
    EXPECT_TRUE(accounting_ok({&a, &b}, pools));
    expect_refused(commit(a, pools, *ta, {0, 0, 0}), "KV commit: no transaction is open");

    // The sequence starts over, its generations keep counting, the lowest pages come back first.
    ta = begin(a, pools, {10, 10, 10});
    ASSERT_TRUE(ta.has_value());
    EXPECT_EQ(ta->generation, 3u);
    EXPECT_EQ(a.slot(PoolKind::kFull, 0), 0);
    ASSERT_TRUE(commit(a, pools, *ta, {10, 10, 10}).has_value());
    EXPECT_TRUE(accounting_ok({&a, &b}, pools));
    a.release_all(pools.full, pools.swa);
    b.release_all(pools.full, pools.swa);
    b.release_all(pools.full, pools.swa);  // twice is harmless
    EXPECT_EQ(pools.full.n_free(), 30);
    EXPECT_EQ(pools.swa.n_free(), 30);
    EXPECT_TRUE(accounting_ok({&a, &b}, pools));
}

TEST(SeqKv, SameCallsGiveTheSameBlockTables) {
    // Two sequences interleaved on fresh pools, twice: the same page ids, slot for slot.
    const auto run = [] {
        Pools pools{PagePool(40), PagePool(40)};
        SeqKv a(make_shape(2, true, true, 130, 600));
        SeqKv b(make_shape(1, true, true, 130, 600));
        std::mt19937_64 rng(11);
        for (int i = 0; i < 200; ++i) {
            SeqKv &seq = rng() % 2 == 0 ? a : b;
            std::vector<int64_t> rows(static_cast<size_t>(seq.shape().n_streams));
            for (int s = 0; s < seq.shape().n_streams; ++s) {
                rows[static_cast<size_t>(s)] = std::min<int64_t>(static_cast<int64_t>(rng() % 40), 600 - seq.length(s));
            }
            auto txn = seq.begin(rows, pools.full, pools.swa);
            if (!txn) {
                seq.release_all(pools.full, pools.swa);
                continue;
            }
            for (int64_t &r : rows) r = r == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(r + 1));
            EXPECT_TRUE(seq.commit(*txn, rows, pools.full, pools.swa).has_value());
        }
        std::vector<int32_t> tables;
        for (const SeqKv *seq : {&a, &b}) {
            for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
                tables.insert(tables.end(), seq->block_table(kind).begin(), seq->block_table(kind).end());
            }
        }
        return tables;
    };
    EXPECT_EQ(run(), run());
}

TEST(SeqKvDeathTest, SlotOfAPositionWithoutAPageDies) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    Pools pools{PagePool(4), PagePool(4)};
    SeqKv seq(make_shape(1, true, false, 0, 1000));
    auto txn = begin(seq, pools, {10});
    ASSERT_TRUE(txn.has_value());
    EXPECT_EQ(seq.slot(PoolKind::kFull, 63), 63);  // past the staged rows, inside their page
    EXPECT_DEATH((void)seq.slot(PoolKind::kFull, 64), "full KV position 64 has no page");
    EXPECT_DEATH((void)seq.slot(PoolKind::kSwa, 0), "sliding KV position 0 has no page");
    EXPECT_DEATH((void)seq.length(1), "stream 1 of 1");
    EXPECT_DEATH((void)SeqKv(make_shape(5, true, true, 512, 1000)), "SeqKv shape: 5 streams");
    EXPECT_DEATH((void)SeqKv(make_shape(2, true, false, 0, 1000)), "SeqKv shape: 2 streams, 1000 positions, window 0");
}

// ---- T2: the transaction fuzz against the dense oracle ----------------------------------------------------

constexpr KvFormat kFormats[] = {KvFormat::kF32, KvFormat::kBf16, KvFormat::kQ8_0, KvFormat::kQ5_1};

// A pool's bytes as a backend would hold them (core/kv_page.h's layout). Pages that become free are poisoned
// after every operation, as a backend reusing them would overwrite them: a block table still pointing at one,
// or a released page that held a live row, shows up as wrong bytes.
struct BytePool {
    KvPageLayout layout;
    std::vector<std::byte> bytes;
    std::vector<int32_t> refs;  // refcounts after the previous operation
    uint8_t poison = 0xa5;

    void poison_freed(const PagePool &pool) {
        for (int32_t p = 0; p < pool.n_pages(); ++p) {
            const int32_t now = pool.refcount(p);
            if (refs[static_cast<size_t>(p)] > 0 && now == 0) {
                std::memset(bytes.data() + p * layout.page_bytes, poison, static_cast<size_t>(layout.page_bytes));
                poison = static_cast<uint8_t>(poison * 5 + 1);
            }
            refs[static_cast<size_t>(p)] = now;
        }
    }
};

BytePool make_byte_pool(const KvPoolSpec &spec) {
    auto layout = kv_page_layout(spec);
    EXPECT_TRUE(layout.has_value()) << layout.error().message;
    BytePool pool;
    pool.layout = *layout;
    pool.bytes.assign(static_cast<size_t>(kv_pool_bytes(spec, pool.layout)), std::byte{0});
    pool.refs.assign(static_cast<size_t>(spec.n_pages), 0);
    return pool;
}

struct FuzzStats {
    int64_t ops = 0, rows = 0, begins = 0, commits = 0, rollbacks = 0, releases = 0, refusals = 0, out_of_pages = 0;
    int64_t swa_released = 0;  // commits that moved the sliding release line (gave back out-of-window pages)
    int64_t edge_lengths = 0;  // committed lengths of W - 1, W, W + 63, W + 64 reached
};

// A row count from `at` (up to max_rows, at most limit): 35 % one that lands the end, or the last row, on an
// edge: W - 1, W, W + 63, W + 64 (511, 512, 575, 576 for W = 512) or a page boundary +- 1; 40 % a decode step
// (1 to 4 rows); 25 % any count.
int64_t pick_rows(std::mt19937_64 &rng, int64_t at, int64_t max_rows, int64_t limit, int64_t window) {
    const int64_t most = std::min(max_rows, limit);
    if (most <= 0) return 0;
    const uint64_t kind = rng() % 20;
    if (kind < 7) {
        const int64_t page_end = (at / kPage + 1) * kPage;
        const int64_t edges[] = {window - 1,   window,   window + kPage - 1, window + kPage,
                                 page_end - 1, page_end, page_end + 1};
        std::vector<int64_t> fits;
        for (const int64_t e : edges) {
            for (const int64_t n : {e - at, e - at + 1}) {
                if (n >= 0 && n <= most) fits.push_back(n);
            }
        }
        if (!fits.empty()) return fits[rng() % fits.size()];
    }
    if (kind < 15) return std::min<int64_t>(most, 1 + static_cast<int64_t>(rng() % 4));
    return static_cast<int64_t>(rng() % static_cast<uint64_t>(most + 1));
}

struct TrunkFuzzConfig {
    uint64_t seed = 0;
    int64_t window = 512;
    int n_seqs = 3;
    int n_ops = 2000;
    int64_t max_rows = 80;  // rows per transaction: more than a page
};

// One sequence of the fuzz: the paged bookkeeping and the dense oracle of the same rows.
struct FuzzSeq {
    std::optional<SeqKv> kv;
    std::optional<KvCache> oracle;
    TxnId txn;
    KvTxn oracle_txn;
};

// Runs one seed; returns "" or the first disagreement, with the operations that led to it.
std::string run_trunk_fuzz(const TrunkFuzzConfig &cfg, FuzzStats &stats) {
    std::mt19937_64 rng(cfg.seed);
    const KvFormat k_format = kFormats[rng() % 4];
    const KvFormat v_format = kFormats[rng() % 4];
    const int64_t window = cfg.window;
    const int64_t max_positions = window + 200;
    const SeqKvShape shape = make_shape(1, true, true, window, max_positions);

    // Two layers per pool with different head counts; the oracle's layers are the full ones, then the sliding.
    const std::vector<KvPoolLayer> full_layers = {{2, 32}, {1, 32}};
    const std::vector<KvPoolLayer> swa_layers = {{1, 32}, {2, 32}};
    KvCacheSpec oracle_spec;
    for (const KvPoolLayer &l : full_layers) oracle_spec.layers.push_back({l.n_kv_heads, l.head_dim, 0});
    for (const KvPoolLayer &l : swa_layers) {
        oracle_spec.layers.push_back({l.n_kv_heads, l.head_dim, static_cast<int>(window)});
    }
    oracle_spec.k_format = k_format;
    oracle_spec.v_format = v_format;
    oracle_spec.capacity = max_positions;
    oracle_spec.max_stage_rows = static_cast<int>(cfg.max_rows);
    const int n_full = static_cast<int>(full_layers.size());

    // Pools a quarter short of every sequence at its longest, so begins are refused now and then.
    const int64_t swa_per_seq = (window - 1 + cfg.max_rows + kPage - 1) / kPage + 1;
    const auto full_pages = static_cast<int32_t>(cfg.n_seqs * shape.max_blocks() * 3 / 4);
    const auto swa_pages = static_cast<int32_t>(cfg.n_seqs * swa_per_seq * 3 / 4);
    Pools pools{PagePool(full_pages), PagePool(swa_pages)};
    BytePool full_bytes = make_byte_pool({k_format, v_format, full_pages, full_layers});
    BytePool swa_bytes = make_byte_pool({k_format, v_format, swa_pages, swa_layers});

    const auto new_oracle = [&] {
        auto c = KvCache::create(oracle_spec);
        EXPECT_TRUE(c.has_value()) << c.error().message;
        return std::move(*c);
    };
    std::vector<FuzzSeq> seqs(static_cast<size_t>(cfg.n_seqs));
    for (FuzzSeq &s : seqs) {
        s.kv.emplace(shape);
        s.oracle.emplace(new_oracle());
    }

    std::deque<std::string> history;  // the last operations, for the failure message
    const auto fail = [&](int op, const std::string &what) {
        std::string out = fmt::format("seed {} (window {}, K {}, V {}), operation {}: {}\n  last operations:", cfg.seed,
                                      window, kv_format_name(k_format), kv_format_name(v_format), op, what);
        for (const std::string &h : history) {
            out += "\n    ";
            out += h;
        }
        return out;
    };

    // Every live row of one sequence: the paged bytes through its block table == the oracle's bytes. Sliding
    // layers: the rows any query can still read, from length - window + 1 (the oracle keeps one row more,
    // length - window, which attention never reads and the paged cache may have released).
    const auto compare = [&](size_t i) -> std::string {
        const SeqKv &kv = *seqs[i].kv;
        const KvCache &oracle = *seqs[i].oracle;
        if (kv.length(0) != oracle.length() || kv.in_txn() != oracle.in_txn()) {
            return fmt::format("sequence {}: paged length {} (open {}), oracle {} (open {})", i, kv.length(0),
                               kv.in_txn(), oracle.length(), oracle.in_txn());
        }
        for (int l = 0; l < oracle.n_layers(); ++l) {
            if (oracle.staged(l) != kv.staged(0)) {
                return fmt::format("sequence {}: paged staged {}, oracle layer {} {}", i, kv.staged(0), l,
                                   oracle.staged(l));
            }
            const bool full = l < n_full;
            const PoolKind kind = full ? PoolKind::kFull : PoolKind::kSwa;
            const BytePool &pool = full ? full_bytes : swa_bytes;
            const int pl = full ? l : l - n_full;  // the layer inside its pool
            const int64_t lo = full ? 0 : std::max(oracle.live_begin(l), oracle.length() - window + 1);
            for (int64_t p = lo; p < oracle.live_end(l); ++p) {
                if (!kv.has_page(kind, p)) {
                    return fmt::format(
                        "sequence {}: {} position {} (layer {}) has no page; the oracle's live rows are [{}, {})",
                        i, pool_kind_name(kind), p, l, oracle.live_begin(l), oracle.live_end(l));
                }
                const int64_t slot = kv.slot(kind, p);
                auto k = oracle.k_row_bytes(l, p);
                auto v = oracle.v_row_bytes(l, p);
                if (!k || !v) return fmt::format("sequence {}: oracle row {} of layer {} unreadable", i, p, l);
                const std::byte *pk = pool.bytes.data() + pool.layout.k_at(pl, slot);
                const std::byte *pv = pool.bytes.data() + pool.layout.v_at(pl, slot);
                if (std::memcmp(pk, k->data(), k->size()) != 0 || std::memcmp(pv, v->data(), v->size()) != 0) {
                    return fmt::format(
                        "sequence {}: {} layer {} position {} (slot {}, page {}): paged bytes differ from the "
                        "oracle's (committed {}, staged {})",
                        i, pool_kind_name(kind), pl, p, slot, slot / kPage, oracle.length(), oracle.staged(l));
                }
            }
        }
        return "";
    };

    std::vector<const SeqKv *> live(seqs.size());
    std::vector<float> k_rows, v_rows;
    for (int op = 0; op < cfg.n_ops; ++op) {
        const size_t i = rng() % seqs.size();
        FuzzSeq &fs = seqs[i];
        SeqKv &kv = *fs.kv;
        KvCache &oracle = *fs.oracle;
        const int64_t length = kv.length(0);
        const int64_t line_before = release_line(kv);
        std::string what;
        const uint64_t dice = rng() % 100;
        ++stats.ops;

        if (dice < 2 || (!kv.in_txn() && length == max_positions && dice < 50)) {
            // The sequence ends; half the time a new one takes its place, half the time it starts over.
            what = fmt::format("seq {} release_all (length {}, open {})", i, length, kv.in_txn());
            kv.release_all(pools.full, pools.swa);
            if (rng() % 2 == 0) fs.kv.emplace(shape);
            fs.oracle.emplace(new_oracle());
            ++stats.releases;
        } else if (dice < 8) {
            // A refused call: it must change nothing, in the sequence or the pools.
            const Observed before = observe(kv, pools);
            Result<void> r;
            const int64_t n = kv.staged(0);
            switch (rng() % 5) {
                case 0: {
                    const int64_t rows[] = {1};
                    auto b = kv.begin(kv.in_txn() ? std::span<const int64_t>(rows)
                                                  : std::span<const int64_t>(),  // wrong stream count
                                      pools.full, pools.swa);
                    r = b ? Result<void>{} : tl::unexpected(b.error());
                    what = fmt::format("seq {} refused begin ({})", i, kv.in_txn() ? "nested" : "0 streams");
                    break;
                }
                case 1: {
                    const int64_t rows[] = {max_positions - length + 1};
                    auto b = kv.begin(rows, pools.full, pools.swa);
                    r = b ? Result<void>{} : tl::unexpected(b.error());
                    what = fmt::format("seq {} refused begin of {} rows at {}", i, rows[0], length);
                    break;
                }
                case 2: {
                    const int64_t keep[] = {n + 1};
                    r = kv.commit(fs.txn, keep, pools.full, pools.swa);
                    what = fmt::format("seq {} refused commit({} of {})", i, n + 1, n);
                    break;
                }
                case 3: {
                    const int64_t keep[] = {0, 0};
                    r = kv.commit(fs.txn, keep, pools.full, pools.swa);
                    what = fmt::format("seq {} refused commit with 2 keep counts", i);
                    break;
                }
                default: {
                    const TxnId stale{kv.last_generation() + 1 - (rng() % 2) * 2};
                    r = kv.rollback(stale, pools.full, pools.swa);
                    what = fmt::format("seq {} refused rollback of generation {}", i, stale.generation);
                    break;
                }
            }
            if (r.has_value()) return fail(op, what + ": was accepted");
            if (!(observe(kv, pools) == before)) {
                return fail(op, what + ": changed the state (" + r.error().message + ")");
            }
            ++stats.refusals;
        } else if (!kv.in_txn()) {
            const int64_t n = pick_rows(rng, length, cfg.max_rows, max_positions - length, window);
            what = fmt::format("seq {} begin {} rows at {}", i, n, length);
            // What a refusal must say: the first pool short of pages, with the counts.
            int64_t needed[2] = {0, 0};
            for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
                for (int64_t b = length / kPage; n > 0 && b <= (length + n - 1) / kPage; ++b) {
                    needed[kind == PoolKind::kFull ? 0 : 1] += kv.block_table(kind)[static_cast<size_t>(b)] < 0;
                }
            }
            const Observed before = observe(kv, pools);
            const int64_t rows[] = {n};
            auto txn = kv.begin(rows, pools.full, pools.swa);
            if (!txn) {
                const PoolKind short_kind = needed[0] > pools.full.n_free() ? PoolKind::kFull : PoolKind::kSwa;
                const PagePool &pool = pools.of(short_kind);
                const std::string want = fmt::format(
                    "{} KV pool out of pages: the step needs {} more, {} of {} are free", pool_kind_name(short_kind),
                    needed[short_kind == PoolKind::kFull ? 0 : 1], pool.n_free(), pool.n_pages());
                if (txn.error().message != want) {
                    return fail(op, what + ": refused with '" + txn.error().message + "', expected '" + want + "'");
                }
                if (!(observe(kv, pools) == before)) return fail(op, what + ": the refusal changed the state");
                what += " (refused: out of pages)";
                ++stats.out_of_pages;
            } else {
                fs.txn = *txn;
                stats.rows += n;
                auto otxn = oracle.begin();
                if (!otxn) return fail(op, what + ": oracle begin: " + otxn.error().message);
                fs.oracle_txn = *otxn;
                // The same f32 rows go to the oracle (which encodes them) and, encoded, to their paged slots.
                const uint64_t salt = rng();
                for (int l = 0; l < oracle.n_layers(); ++l) {
                    const bool full = l < n_full;
                    const PoolKind kind = full ? PoolKind::kFull : PoolKind::kSwa;
                    BytePool &pool = full ? full_bytes : swa_bytes;
                    const int pl = full ? l : l - n_full;
                    const int64_t e = oracle.layout(l).row_elems;
                    k_rows.clear();
                    v_rows.clear();
                    for (int64_t p = length; p < length + n; ++p) {
                        const std::vector<float> kr = row_values(l, p, salt, false, e);
                        const std::vector<float> vr = row_values(l, p, salt, true, e);
                        const int64_t slot = kv.slot(kind, p);
                        kv_encode(k_format, kr.data(), e, pool.bytes.data() + pool.layout.k_at(pl, slot));
                        kv_encode(v_format, vr.data(), e, pool.bytes.data() + pool.layout.v_at(pl, slot));
                        k_rows.insert(k_rows.end(), kr.begin(), kr.end());
                        v_rows.insert(v_rows.end(), vr.begin(), vr.end());
                    }
                    if (auto ok = oracle.stage(fs.oracle_txn, l, k_rows, v_rows, n); !ok) {
                        return fail(op, what + ": oracle stage: " + ok.error().message);
                    }
                }
                ++stats.begins;
            }
        } else if (dice < 33) {
            what = fmt::format("seq {} rollback of {} rows at {}", i, kv.staged(0), length);
            if (auto ok = kv.rollback(fs.txn, pools.full, pools.swa); !ok) {
                return fail(op, what + ": " + ok.error().message);
            }
            if (auto ok = oracle.rollback(fs.oracle_txn); !ok) {
                return fail(op, what + ": oracle: " + ok.error().message);
            }
            ++stats.rollbacks;
        } else {
            const int64_t staged = kv.staged(0);
            const uint64_t how = rng() % 4;
            const int64_t keep = how == 0 ? staged : how == 1 ? 0 : pick_rows(rng, length, staged, staged, window);
            what = fmt::format("seq {} commit {} of {} rows at {}", i, keep, staged, length);
            const int64_t keeps[] = {keep};
            if (auto ok = kv.commit(fs.txn, keeps, pools.full, pools.swa); !ok) {
                return fail(op, what + ": " + ok.error().message);
            }
            if (auto ok = oracle.commit(fs.oracle_txn, keep); !ok) {
                return fail(op, what + ": oracle: " + ok.error().message);
            }
            const int64_t now = kv.length(0);
            stats.edge_lengths += now == window - 1 || now == window || now == window + 63 || now == window + 64;
            stats.swa_released += release_line(kv) > line_before;
            ++stats.commits;
        }

        history.push_back(what);
        if (history.size() > 8) history.pop_front();
        full_bytes.poison_freed(pools.full);
        swa_bytes.poison_freed(pools.swa);
        for (size_t j = 0; j < seqs.size(); ++j) live[j] = &*seqs[j].kv;
        if (std::string e = compare(i); !e.empty()) return fail(op, e);
        if (std::string e = accounting_error(live, pools.full, pools.swa); !e.empty()) return fail(op, e);
        if (op % 64 == 63) {  // every other sequence too, now and then (the touched one is compared above)
            for (size_t j = 0; j < seqs.size(); ++j) {
                if (std::string e = compare(j); !e.empty()) return fail(op, e);
            }
        }
    }
    for (size_t j = 0; j < seqs.size(); ++j) {
        if (std::string e = compare(j); !e.empty()) return fail(cfg.n_ops, e);
    }
    return "";
}

TEST(PagedKvFuzz, TrunkRowsMatchTheDenseOracle) {
    // 20 seeds over windows of 512 (the Step-3.5 edges 511, 512, 575, 576) and of 130, 150, 200 (3+ pages).
    const int64_t windows[] = {512, 130, 150, 200};
    FuzzStats stats;
    for (uint64_t seed = 1; seed <= 20; ++seed) {
        TrunkFuzzConfig cfg;
        cfg.seed = seed;
        cfg.window = windows[seed % 4];
        EXPECT_EQ(run_trunk_fuzz(cfg, stats), "");
    }
    // The fuzz reached what it is for.
    EXPECT_GT(stats.rows, 200000);
    EXPECT_GT(stats.begins, 9000);
    EXPECT_GT(stats.commits, 6000);
    EXPECT_GT(stats.rollbacks, 2000);
    EXPECT_GT(stats.releases, 400);
    EXPECT_GT(stats.refusals, 1000);
    EXPECT_GT(stats.out_of_pages, 200);
    EXPECT_GT(stats.swa_released, 250);
    EXPECT_GT(stats.edge_lengths, 250);
    std::printf(
        "T2 trunk fuzz: %lld ops: %lld rows staged by %lld begins (%lld refused for pages), %lld commits, "
        "%lld rollbacks, %lld release_all, %lld refusals, %lld commits moving the sliding window, %lld edge lengths\n",
        static_cast<long long>(stats.ops), static_cast<long long>(stats.rows), static_cast<long long>(stats.begins),
        static_cast<long long>(stats.out_of_pages), static_cast<long long>(stats.commits),
        static_cast<long long>(stats.rollbacks), static_cast<long long>(stats.releases),
        static_cast<long long>(stats.refusals), static_cast<long long>(stats.swa_released),
        static_cast<long long>(stats.edge_lengths));
}

// ---- MTP streams: bookkeeping fuzz ------------------------------------------------------------------------

std::string join(const std::vector<int64_t> &values) {
    std::string out;
    for (const int64_t v : values) {
        if (!out.empty()) out += ' ';
        out += std::to_string(v);
    }
    return out;
}

// Every stream's rows carry a tag naming (sequence, stream, position, transaction) in a tag pool shaped like
// the byte pools (one tag per slot and stream); the rows a query can still read must keep their tags.
uint64_t row_tag(uint64_t seq_uid, int stream, int64_t position, uint64_t salt) {
    return splitmix64(splitmix64(seq_uid * 8 + static_cast<uint64_t>(stream)) ^ static_cast<uint64_t>(position)) ^ salt;
}

std::string run_mtp_fuzz(uint64_t seed, FuzzStats &stats) {
    std::mt19937_64 rng(seed);
    const int64_t windows[] = {512, 130, 150, 200};
    const int64_t window = windows[rng() % 4];
    const uint64_t trunk = rng() % 3;  // 0: full and sliding, 1: full only, 2: sliding only
    const bool trunk_full = trunk != 2;
    const bool trunk_sliding = trunk != 1;
    const int64_t max_positions = window + 200;
    const int64_t max_rows = 80;
    const int n_seqs = 4;
    const int64_t max_blocks = (max_positions + kPage - 1) / kPage;
    Pools pools{PagePool(static_cast<int32_t>(n_seqs * max_blocks * 3 / 4)),
                PagePool(static_cast<int32_t>(n_seqs * ((window + 2 * max_rows + 3) / kPage + 2) * 3 / 4))};
    std::vector<uint64_t> tags[2] = {
        std::vector<uint64_t>(static_cast<size_t>(pools.full.n_pages() * kPage) * kMaxStreams),
        std::vector<uint64_t>(static_cast<size_t>(pools.swa.n_pages() * kPage) * kMaxStreams)};
    std::vector<int32_t> refs[2] = {std::vector<int32_t>(static_cast<size_t>(pools.full.n_pages()), 0),
                                    std::vector<int32_t>(static_cast<size_t>(pools.swa.n_pages()), 0)};

    struct MtpSeq {
        std::optional<SeqKv> kv;
        uint64_t uid = 0;
        TxnId txn;
        std::vector<std::vector<uint64_t>> salt;  // [stream][position]: the transaction that staged the row
    };
    uint64_t next_uid = 1;
    const auto start = [&](MtpSeq &s) {
        const int n_streams = 1 + static_cast<int>(rng() % kMaxStreams);
        s.kv.emplace(make_shape(n_streams, trunk_full, trunk_sliding, window, max_positions));
        s.uid = next_uid++;
        s.salt.assign(static_cast<size_t>(n_streams), std::vector<uint64_t>(static_cast<size_t>(max_positions), 0));
    };
    std::vector<MtpSeq> seqs(static_cast<size_t>(n_seqs));
    for (MtpSeq &s : seqs) start(s);

    const auto tag_at = [&](PoolKind kind, int64_t slot, int stream) -> uint64_t & {
        return tags[kind == PoolKind::kFull ? 0 : 1][static_cast<size_t>(slot * kMaxStreams + stream)];
    };
    std::vector<const SeqKv *> live(seqs.size());
    std::deque<std::string> history;
    const auto fail = [&](int op, const std::string &what) {
        std::string out = fmt::format("seed {} (window {}, trunk {}{}), operation {}: {}\n  last operations:", seed,
                                      window, trunk_full ? "full" : "", trunk_sliding ? "+sliding" : "", op, what);
        for (const std::string &h : history) {
            out += "\n    ";
            out += h;
        }
        return out;
    };

    for (int op = 0; op < 3000; ++op) {
        const size_t i = rng() % seqs.size();
        MtpSeq &ms = seqs[i];
        SeqKv &kv = *ms.kv;
        const int n_streams = kv.shape().n_streams;
        std::string what;
        const uint64_t dice = rng() % 100;
        ++stats.ops;
        if (dice < 4) {
            what = fmt::format("seq {} release_all", i);
            kv.release_all(pools.full, pools.swa);
            start(ms);
            ++stats.releases;
        } else if (!kv.in_txn()) {
            // MTP rows lag the trunk: MTP layer k stages up to where the trunk's committed rows reach, minus k.
            std::vector<int64_t> rows(static_cast<size_t>(n_streams));
            for (int s = 0; s < n_streams; ++s) {
                const int64_t at = kv.length(s);
                const int64_t limit = s == 0 ? max_positions - at : std::min(max_positions, kv.length(0) + 4) - at;
                rows[static_cast<size_t>(s)] = std::max<int64_t>(0, pick_rows(rng, at, max_rows, limit, window));
            }
            what = fmt::format("seq {} begin {}", i, join(rows));
            const Observed before = observe(kv, pools);
            // pages_needed predicts begin: a refusal exactly when a pool has fewer free pages, else exactly the
            // pages taken.
            const std::array<int64_t, 2> needed = kv.pages_needed(rows);
            const bool fits = needed[0] <= pools.full.n_free() && needed[1] <= pools.swa.n_free();
            const int32_t free_before[2] = {pools.full.n_free(), pools.swa.n_free()};
            auto txn = kv.begin(rows, pools.full, pools.swa);
            if (txn.has_value() != fits) {
                return fail(op, fmt::format("{}: pages_needed {} {} against {} {} free, but begin {}", what, needed[0],
                                            needed[1], free_before[0], free_before[1],
                                            txn ? "succeeded" : txn.error().message));
            }
            if (txn && (free_before[0] - pools.full.n_free() != needed[0] ||
                        free_before[1] - pools.swa.n_free() != needed[1])) {
                return fail(op, fmt::format("{}: begin took {} {} pages, pages_needed said {} {}", what,
                                            free_before[0] - pools.full.n_free(), free_before[1] - pools.swa.n_free(),
                                            needed[0], needed[1]));
            }
            if (!txn) {
                if (txn.error().message.find("KV pool out of pages") == std::string::npos) {
                    return fail(op, what + ": refused: " + txn.error().message);
                }
                if (!(observe(kv, pools) == before)) return fail(op, what + ": the refusal changed the state");
                ++stats.out_of_pages;
            } else {
                ms.txn = *txn;
                for (const int64_t n : rows) stats.rows += n;
                const uint64_t salt = rng();
                for (int s = 0; s < n_streams; ++s) {
                    for (int64_t p = kv.length(s); p < kv.length(s) + rows[static_cast<size_t>(s)]; ++p) {
                        ms.salt[static_cast<size_t>(s)][static_cast<size_t>(p)] = salt;
                        for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
                            if (stream_uses(kv.shape(), kind, s)) {
                                tag_at(kind, kv.slot(kind, p), s) = row_tag(ms.uid, s, p, salt);
                            }
                        }
                    }
                }
                ++stats.begins;
            }
        } else if (dice < 30) {
            what = fmt::format("seq {} rollback", i);
            if (auto ok = kv.rollback(ms.txn, pools.full, pools.swa); !ok) {
                return fail(op, what + ": " + ok.error().message);
            }
            ++stats.rollbacks;
        } else {
            std::vector<int64_t> keep(static_cast<size_t>(n_streams));
            for (int s = 0; s < n_streams; ++s) {
                const int64_t staged = kv.staged(s);
                keep[static_cast<size_t>(s)] =
                    rng() % 3 == 0 ? staged : pick_rows(rng, kv.length(s), staged, staged, window);
            }
            std::vector<int64_t> staged(static_cast<size_t>(n_streams));
            for (int s = 0; s < n_streams; ++s) staged[static_cast<size_t>(s)] = kv.staged(s);
            what = fmt::format("seq {} commit {} of {}", i, join(keep), join(staged));
            const int64_t line_before = release_line(kv);
            if (auto ok = kv.commit(ms.txn, keep, pools.full, pools.swa); !ok) {
                return fail(op, what + ": " + ok.error().message);
            }
            stats.swa_released += release_line(kv) > line_before;
            ++stats.commits;
        }
        history.push_back(what);
        if (history.size() > 8) history.pop_front();

        // Freed pages lose their tags, as a backend reusing them would overwrite their rows.
        for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
            const size_t k = kind == PoolKind::kFull ? 0 : 1;
            const PagePool &pool = pools.of(kind);
            for (int32_t p = 0; p < pool.n_pages(); ++p) {
                if (refs[k][static_cast<size_t>(p)] > 0 && pool.refcount(p) == 0) {
                    std::fill_n(tags[k].begin() + p * kPage * kMaxStreams, kPage * kMaxStreams, uint64_t{0});
                }
                refs[k][static_cast<size_t>(p)] = pool.refcount(p);
            }
        }
        for (size_t j = 0; j < seqs.size(); ++j) live[j] = &*seqs[j].kv;
        if (std::string e = accounting_error(live, pools.full, pools.swa); !e.empty()) return fail(op, e);
        // Every readable row of every stream of the touched sequence: full pool from 0, sliding pool from the
        // stream's next window (length - window + 1); committed and staged.
        const SeqKv &seq = *ms.kv;
        for (int s = 0; s < seq.shape().n_streams; ++s) {
            for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
                if (!stream_uses(seq.shape(), kind, s)) continue;
                const int64_t lo = kind == PoolKind::kFull ? 0 : std::max(seq.first(s), seq.length(s) - window + 1);
                for (int64_t p = lo; p < seq.length(s) + seq.staged(s); ++p) {
                    if (!seq.has_page(kind, p)) {
                        return fail(op, fmt::format("seq {} stream {}: {} position {} has no page", i, s,
                                                    pool_kind_name(kind), p));
                    }
                    const uint64_t want =
                        row_tag(ms.uid, s, p, ms.salt[static_cast<size_t>(s)][static_cast<size_t>(p)]);
                    if (tag_at(kind, seq.slot(kind, p), s) != want) {
                        return fail(op, fmt::format("seq {} stream {}: {} position {} (slot {}) lost its row", i, s,
                                                    pool_kind_name(kind), p, seq.slot(kind, p)));
                    }
                }
            }
        }
    }
    return "";
}

TEST(PagedKvFuzz, MtpStreamsKeepTheAccountingExact) {
    FuzzStats stats;
    for (uint64_t seed = 1; seed <= 20; ++seed) EXPECT_EQ(run_mtp_fuzz(seed, stats), "");
    EXPECT_GT(stats.begins, 10000);
    EXPECT_GT(stats.commits, 5000);
    EXPECT_GT(stats.out_of_pages, 20);
    EXPECT_GT(stats.swa_released, 150);
    std::printf("MTP bookkeeping fuzz: %lld ops: %lld rows staged by %lld begins (%lld refused for pages), "
                "%lld commits (%lld moving the sliding window), %lld rollbacks, %lld release_all\n",
                static_cast<long long>(stats.ops), static_cast<long long>(stats.rows),
                static_cast<long long>(stats.begins), static_cast<long long>(stats.out_of_pages),
                static_cast<long long>(stats.commits), static_cast<long long>(stats.swa_released),
                static_cast<long long>(stats.rollbacks), static_cast<long long>(stats.releases));
}

}  // namespace
}  // namespace memra::kv
