// kv/prefix_cache.h and the PagePool marks under it. PagePool: cached pages become evictable when their last
// holder lets go, in that order; retain and uncache take them off the list. PrefixCache: a chain of published
// blocks matches exactly the prompts that begin with the same blocks (never the last token's block), a sliding
// page evicted leaves a tombstone that cuts the match back until the window before its end is whole, a full page
// evicted drops its entry, equal blocks are published once, and a sequence that adopts a match then writes only
// pages of its own. The fuzz runs sequences over prompts that share prefixes, with adoption, transactions,
// publication, releases and eviction at random: every adopted page holds the rows the adopting sequence's own
// tokens would have written (each page is tagged with the hash of the tokens its rows were computed from), no
// staged row lands in a shared or cached page, and the pool and cache bookkeeping checks after every operation.
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "core/kv_page.h"
#include "kv/paged_kv.h"
#include "kv/prefix_cache.h"

namespace memra::kv {
namespace {

constexpr int64_t kPage = kKvPageRows;

SeqKvShape hybrid_shape(int64_t window, int64_t max_positions) {
    SeqKvShape s;
    s.n_streams = 1;
    s.trunk_full = true;
    s.trunk_sliding = true;
    s.window = window;
    s.max_positions = max_positions;
    return s;
}

// Tokens of `blocks` whole blocks, block b filled with ids[b].
std::vector<int32_t> blocks_of(std::initializer_list<int32_t> ids, int64_t extra = 0) {
    std::vector<int32_t> t;
    for (const int32_t id : ids) t.insert(t.end(), kPage, id);
    t.insert(t.end(), static_cast<size_t>(extra), 7);
    return t;
}

// Commits `rows` trunk rows on a sequence in one transaction.
void commit_rows(SeqKv &kv, int64_t rows, PagePool &full, PagePool &swa, bool release_window = true) {
    const int64_t r[1] = {rows};
    auto txn = kv.begin(r, full, swa);
    ASSERT_TRUE(txn.has_value()) << txn.error().message;
    ASSERT_TRUE(kv.commit(*txn, r, full, swa, release_window).has_value());
}

// Publishes blocks [from, length / 64) of a sequence as the engine does; returns the last chain id.
uint64_t publish_blocks(PrefixCache &cache, const SeqKv &kv, std::span<const int32_t> tokens, int64_t from,
                        uint64_t chain, PagePool &full, PagePool &swa) {
    for (int64_t b = from; b < kv.length(0) / kPage; ++b) {
        chain = cache.publish(chain, tokens.subspan(static_cast<size_t>(b * kPage), kPage),
                              kv.block_table(PoolKind::kFull)[static_cast<size_t>(b)],
                              kv.block_table(PoolKind::kSwa)[static_cast<size_t>(b)], full, swa);
        EXPECT_NE(chain, 0u);
    }
    return chain;
}

TEST(PagePoolCache, CachedPagesBecomeEvictableInTheOrderTheirHoldersLetGo) {
    PagePool pool(4);
    const int32_t a = *pool.alloc(), b = *pool.alloc(), c = *pool.alloc();
    pool.set_cached(a);
    pool.set_cached(b);
    pool.set_cached(c);
    EXPECT_EQ(pool.n_evictable(), 0);
    EXPECT_EQ(pool.oldest_evictable(), -1);
    pool.release(b);
    pool.release(a);
    pool.release(c);
    EXPECT_EQ(pool.n_free(), 1);
    EXPECT_EQ(pool.n_evictable(), 3);
    EXPECT_EQ(pool.n_available(), 4);
    EXPECT_EQ(pool.oldest_evictable(), b);
    pool.retain(b);  // a sequence reuses it: no longer evictable
    EXPECT_EQ(pool.oldest_evictable(), a);
    EXPECT_EQ(pool.n_evictable(), 2);
    pool.uncache(a);  // evicted: free again
    EXPECT_EQ(pool.n_free(), 2);
    EXPECT_EQ(pool.oldest_evictable(), c);
    pool.release(b);
    pool.uncache(c);
    EXPECT_EQ(pool.oldest_evictable(), b);
    pool.uncache(b);
    EXPECT_EQ(pool.n_free(), 4);
    EXPECT_EQ(pool.n_evictable(), 0);
    EXPECT_EQ(pool.alloc(), 0);  // the lowest free page first, as before
}

TEST(PagePoolCacheDeathTest, MisuseDies) {
    PagePool pool(2);
    EXPECT_DEATH(pool.retain(0), "retain of page 0, which is free");
    EXPECT_DEATH(pool.set_cached(0), "page 0 cannot be cached");
    EXPECT_DEATH(pool.uncache(1), "page 1 is not cached");
}

TEST(PrefixCache, MatchesWholeBlocksFromTheLeftAndLeavesATokenToCompute) {
    const SeqKvShape shape = hybrid_shape(128, 1024);
    PagePool full(32), swa(32);
    PrefixCache cache(shape, 32, 32);
    const std::vector<int32_t> a = blocks_of({1, 2, 3, 4, 5}, 10);
    auto kv = std::make_unique<SeqKv>(shape);
    commit_rows(*kv, static_cast<int64_t>(a.size()), full, swa, false);
    publish_blocks(cache, *kv, a, 0, 0, full, swa);
    const std::vector<int32_t> a_full(kv->block_table(PoolKind::kFull).begin(), kv->block_table(PoolKind::kFull).end());
    const std::vector<int32_t> a_swa(kv->block_table(PoolKind::kSwa).begin(), kv->block_table(PoolKind::kSwa).end());
    kv->release_out_of_window(swa);  // blocks 0-2 leave A's window; the cache keeps their sliding pages
    EXPECT_EQ(kv->block_table(PoolKind::kSwa)[0], -1);
    EXPECT_TRUE(swa.evictable(a_swa[0]));
    EXPECT_EQ(cache.entries(), 5);
    ASSERT_TRUE(cache.check(full, swa).has_value());

    // While A holds every page, a match shares them.
    PrefixCache::Match m = cache.match(a);
    EXPECT_EQ(m.blocks, 5);
    // Exactly five blocks: the last one is left to compute (its logits are needed).
    EXPECT_EQ(cache.match(blocks_of({1, 2, 3, 4, 5})).blocks, 4);
    EXPECT_EQ(cache.match(blocks_of({1, 2, 3, 9, 5}, 1)).blocks, 3);
    EXPECT_EQ(cache.match(blocks_of({2, 1}, 1)).blocks, 0);
    EXPECT_EQ(cache.match(std::vector<int32_t>(a.begin(), a.begin() + 64)).blocks, 0);
    // A block equal to a cached one but after another parent does not match.
    EXPECT_EQ(cache.match(blocks_of({9, 2, 3}, 1)).blocks, 0);

    const std::vector<int32_t> b = blocks_of({1, 2, 3, 8}, 3);
    m = cache.match(b);
    ASSERT_EQ(m.blocks, 3);
    EXPECT_EQ(m.swa_first, 1);  // position 192 reads from 65: blocks 1 and 2
    ASSERT_EQ(m.full.size(), 3u);
    ASSERT_EQ(m.swa.size(), 2u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(m.full[i], a_full[i]);
    EXPECT_EQ(m.swa[0], a_swa[1]);
    EXPECT_EQ(m.swa[1], a_swa[2]);

    SeqKv other(shape);
    other.adopt(m.full, m.swa_first, m.swa, full, swa);
    EXPECT_EQ(other.length(0), 192);
    EXPECT_EQ(full.refcount(a_full[0]), 2);
    EXPECT_EQ(swa.refcount(a_swa[1]), 1);  // A let it go; the adopter holds it
    EXPECT_FALSE(swa.evictable(a_swa[1]));
    EXPECT_EQ(other.block_table(PoolKind::kSwa)[0], -1);  // out of the window: as if released
    // Its own rows go to pages of its own.
    commit_rows(other, 70, full, swa, false);
    const int32_t own = other.block_table(PoolKind::kFull)[3];
    EXPECT_EQ(full.refcount(own), 1);
    EXPECT_FALSE(full.cached(own));
    // Its block "8" after 1, 2, 3 is new; A's block "4" published again returns the entry there already and
    // leaves the page offered private.
    const int64_t before = cache.entries();
    const uint64_t chain8 = cache.publish(m.chain, std::span<const int32_t>(b).subspan(3 * kPage, kPage), own,
                                          other.block_table(PoolKind::kSwa)[3], full, swa);
    EXPECT_EQ(cache.entries(), before + 1);
    EXPECT_TRUE(full.cached(own));
    const uint64_t chain4 = cache.match(a).chain;  // the chain through A's five blocks
    EXPECT_NE(chain8, 0u);
    const int32_t spare = *full.alloc();
    EXPECT_EQ(cache.publish(0, std::span<const int32_t>(a).subspan(0, kPage), spare, -1, full, swa),
              cache.match(blocks_of({1}, 1)).chain);
    EXPECT_FALSE(full.cached(spare));
    EXPECT_EQ(cache.entries(), before + 1);
    EXPECT_NE(chain4, chain8);
    full.release(spare);
    other.release_all(full, swa);
    kv->release_all(full, swa);
    ASSERT_TRUE(cache.check(full, swa).has_value());
    EXPECT_EQ(full.n_available(), full.n_pages());
    cache.clear(full, swa);
    EXPECT_EQ(full.n_free(), full.n_pages());
    EXPECT_EQ(swa.n_free(), swa.n_pages());
    EXPECT_EQ(cache.entries(), 0);
}

TEST(PrefixCache, EvictionTakesTheTailFirstAndLeavesSlidingTombstones) {
    const SeqKvShape shape = hybrid_shape(128, 1024);
    PagePool full(16), swa(16);
    PrefixCache cache(shape, 16, 16);
    const std::vector<int32_t> a = blocks_of({1, 2, 3, 4, 5}, 1);
    {
        SeqKv kv(shape);
        commit_rows(kv, static_cast<int64_t>(a.size()) - 1, full, swa, false);
        publish_blocks(cache, kv, a, 0, 0, full, swa);
        kv.release_out_of_window(swa);
        kv.release_all(full, swa);  // tail first: block 4's pages are the oldest evictable
    }
    EXPECT_EQ(full.n_evictable(), 5);
    EXPECT_EQ(swa.n_evictable(), 5);
    EXPECT_EQ(cache.match(a).blocks, 5);
    // Blocks 0-2's sliding pages left the window while A ran: they are the oldest, and evicting them leaves
    // tombstones a five-block match does not need (its window is blocks 3 and 4).
    EXPECT_EQ(cache.evict(PoolKind::kSwa, 3, full, swa), 3);
    EXPECT_EQ(cache.entries(), 5);
    EXPECT_EQ(cache.match(a).blocks, 5);
    // Then block 4's (A gave its blocks back tail first): no shorter match has a whole window either.
    EXPECT_EQ(cache.evict(PoolKind::kSwa, 1, full, swa), 1);
    EXPECT_EQ(cache.entries(), 5);
    EXPECT_EQ(cache.match(a).blocks, 0);
    // A full page takes its entry (and its sliding page) along; blocks after it are out of reach.
    EXPECT_EQ(cache.evict(PoolKind::kFull, 1, full, swa), 1);  // block 4's, the oldest
    EXPECT_EQ(cache.entries(), 4);
    ASSERT_TRUE(cache.check(full, swa).has_value());
    const int32_t oldest = full.oldest_evictable();
    EXPECT_EQ(cache.evict(PoolKind::kFull, 100, full, swa), 4);
    EXPECT_FALSE(full.cached(oldest));
    EXPECT_EQ(cache.entries(), 0);
    EXPECT_EQ(cache.match(a).blocks, 0);
    EXPECT_EQ(full.n_free(), 16);
    EXPECT_EQ(swa.n_free(), 16);
    ASSERT_TRUE(cache.check(full, swa).has_value());
}

TEST(PrefixCache, ADisabledCacheMatchesAndPublishesNothing) {
    PrefixCache cache;
    PagePool full(2), swa(2);
    EXPECT_EQ(cache.match(blocks_of({1, 2}, 1)).blocks, 0);
    const int32_t page = *full.alloc();
    EXPECT_EQ(cache.publish(0, blocks_of({1}), page, -1, full, swa), 0u);
    EXPECT_FALSE(full.cached(page));
    EXPECT_TRUE(cache.check(full, swa).has_value());
}

// A hash of the tokens [0, 64 (b + 1)): what the rows of block b are a function of.
uint64_t prefix_tag(std::span<const int32_t> tokens, int64_t b) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < (b + 1) * kPage; ++i) {
        h = (h ^ static_cast<uint32_t>(tokens[static_cast<size_t>(i)])) * 1099511628211ull;
    }
    return h;
}

TEST(PrefixCacheFuzz, AdoptedPagesHoldTheRowsOfTheAdoptersTokens) {
    for (const int64_t window : {int64_t{40}, int64_t{128}, int64_t{200}}) {
        SCOPED_TRACE(window);
        const SeqKvShape shape = hybrid_shape(window, 640);
        PagePool full(48), swa(40);
        PrefixCache cache(shape, 48, 40);
        std::map<int32_t, uint64_t> full_tag, swa_tag;  // page -> the tag of the rows written into it
        struct Seq {
            std::unique_ptr<SeqKv> kv;
            std::vector<int32_t> tokens;
            int64_t published = 0;
            uint64_t chain = 0;
        };
        std::vector<Seq> seqs;
        std::mt19937_64 rng(static_cast<uint64_t>(window));
        int64_t adopted_rows = 0;
        for (int op = 0; op < 3000; ++op) {
            const uint64_t pick = rng() % 10;
            if (pick < 2 && seqs.size() < 6) {
                // A new sequence: blocks over a two-letter alphabet, so prefixes are shared often.
                Seq s;
                s.kv = std::make_unique<SeqKv>(shape);
                const int64_t n = 1 + static_cast<int64_t>(rng() % 600);
                int32_t value = 0;
                for (int64_t i = 0; i < n; ++i) {
                    if (i % kPage == 0) value = (i / kPage) % 3 == 2 ? static_cast<int32_t>(rng() % 2) : 0;
                    s.tokens.push_back(value);
                }
                const PrefixCache::Match m = cache.match(s.tokens);
                if (m.blocks > 0) {
                    s.kv->adopt(m.full, m.swa_first, m.swa, full, swa);
                    for (int64_t b = 0; b < m.blocks; ++b) {
                        const uint64_t want = prefix_tag(s.tokens, b);
                        ASSERT_EQ(full_tag.at(m.full[static_cast<size_t>(b)]), want) << "block " << b;
                        if (b >= m.swa_first) {
                            ASSERT_EQ(swa_tag.at(m.swa[static_cast<size_t>(b - m.swa_first)]), want) << "block " << b;
                        }
                    }
                    s.published = m.blocks;
                    s.chain = m.chain;
                    adopted_rows += m.blocks * kPage;
                }
                seqs.push_back(std::move(s));
            } else if (pick < 8 && !seqs.empty()) {
                // A step of one sequence: stage, commit a prefix of the rows, publish, release out of window.
                Seq &s = seqs[rng() % seqs.size()];
                const int64_t left = static_cast<int64_t>(s.tokens.size()) - s.kv->length(0);
                if (left == 0) continue;
                const auto most = static_cast<uint64_t>(std::min<int64_t>(left, 150));
                const int64_t r[1] = {1 + static_cast<int64_t>(rng() % most)};
                const std::array<int64_t, 2> need = s.kv->pages_needed(r);
                if (need[0] > full.n_free()) cache.evict(PoolKind::kFull, need[0] - full.n_free(), full, swa);
                if (need[1] > swa.n_free()) cache.evict(PoolKind::kSwa, need[1] - swa.n_free(), full, swa);
                auto txn = s.kv->begin(r, full, swa);
                if (!txn) continue;  // out of pages even after eviction
                // Staged rows land only in pages of this sequence alone, never cached: write their tags.
                for (int64_t p = s.kv->length(0); p < s.kv->length(0) + r[0]; ++p) {
                    const int64_t b = p / kPage;
                    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
                        const int32_t page = s.kv->block_table(kind)[static_cast<size_t>(b)];
                        const PagePool &pool = kind == PoolKind::kFull ? full : swa;
                        ASSERT_EQ(pool.refcount(page), 1);
                        ASSERT_FALSE(pool.cached(page));
                        // A block the tokens do not fill is never published: its tag is never read.
                        const bool whole = (b + 1) * kPage <= static_cast<int64_t>(s.tokens.size());
                        (kind == PoolKind::kFull ? full_tag : swa_tag)[page] = whole ? prefix_tag(s.tokens, b) : 0;
                    }
                }
                const int64_t keep[1] = {static_cast<int64_t>(rng() % static_cast<uint64_t>(r[0] + 1))};
                ASSERT_TRUE(s.kv->commit(*txn, keep, full, swa, false).has_value());
                for (; s.published >= 0 && s.published < s.kv->length(0) / kPage; ++s.published) {
                    const auto b = static_cast<size_t>(s.published);
                    const uint64_t chain =
                        cache.publish(s.chain, std::span<const int32_t>(s.tokens).subspan(b * kPage, kPage),
                                      s.kv->block_table(PoolKind::kFull)[b], s.kv->block_table(PoolKind::kSwa)[b], full,
                                      swa);
                    if (chain == 0) {
                        s.published = -2;
                        break;
                    }
                    s.chain = chain;
                }
                s.kv->release_out_of_window(swa);
            } else if (!seqs.empty()) {
                const size_t i = rng() % seqs.size();
                seqs[i].kv->release_all(full, swa);
                seqs.erase(seqs.begin() + static_cast<std::ptrdiff_t>(i));
            }
            auto ok = cache.check(full, swa);
            ASSERT_TRUE(ok.has_value()) << ok.error().message;
            for (const PagePool *pool : {&full, &swa}) {
                int32_t free = 0, evictable = 0;
                for (int32_t p = 0; p < pool->n_pages(); ++p) {
                    if (pool->refcount(p) == 0) ++(pool->cached(p) ? evictable : free);
                }
                ASSERT_EQ(free, pool->n_free());
                ASSERT_EQ(evictable, pool->n_evictable());
            }
        }
        EXPECT_GT(adopted_rows, 0);
        for (Seq &s : seqs) s.kv->release_all(full, swa);
        cache.clear(full, swa);
        EXPECT_EQ(full.n_free(), full.n_pages());
        EXPECT_EQ(swa.n_free(), swa.n_pages());
    }
}

}  // namespace
}  // namespace memra::kv
