// dense_kv_cache.h: the dense oracle cache's own contract. Spec validation and layout, every format's bytes through
// the cache, every refusal (with message fragments, leaving the state unchanged), the seed TP gate's
// transaction walk (partial commit / rollback / recommit == a run that never speculated, D7), monotonic
// generations, copy-growth, and long randomized sliding-ring runs against a plain reference of all rows.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dense_kv_cache.h"
#include "kv_test_util.h"

namespace memra::kv {
namespace {

using test::reference_decode;
using test::reference_encode;
using test::row_values;
using test::same_bits;
using test::snapshot;
using test::Snapshot;
using test::stage_all;
using test::stage_rows;

constexpr KvFormat kFormats[] = {KvFormat::kF32, KvFormat::kBf16, KvFormat::kQ8_0, KvFormat::kQ5_1};

// Two full layers and two sliding ones (the last one stands for an MTP layer), with different head
// counts and head sizes per layer, as Step-3.5's full and sliding layers have.
KvCacheSpec mixed_spec(KvFormat k, KvFormat v, int64_t capacity, int max_stage_rows, int window_a = 2,
                       int window_b = 3) {
    KvCacheSpec spec;
    spec.layers = {{2, 64, 0}, {1, 32, window_a}, {1, 32, 0}, {2, 64, window_b}};
    spec.k_format = k;
    spec.v_format = v;
    spec.capacity = capacity;
    spec.max_stage_rows = max_stage_rows;
    return spec;
}

KvCache make_cache(const KvCacheSpec &spec) {
    auto cache = KvCache::create(spec);
    EXPECT_TRUE(cache.has_value()) << cache.error().message;
    return std::move(*cache);
}

template <class T>
void expect_error(const Result<T> &r, std::initializer_list<const char *> fragments) {
    ASSERT_FALSE(r.has_value()) << "expected a refusal";
    for (const char *f : fragments) {
        EXPECT_NE(r.error().message.find(f), std::string::npos) << "missing '" << f << "' in: " << r.error().message;
    }
}

// ---- Spec, layout, memory -------------------------------------------------------------------------

TEST(KvCacheSpec, RefusesBadSpecs) {
    auto good = mixed_spec(KvFormat::kQ8_0, KvFormat::kQ5_1, 16, 4);
    ASSERT_TRUE(KvCache::create(good).has_value());

    auto s = good;
    s.layers.clear();
    expect_error(KvCache::create(s), {"at least one layer"});
    s = good;
    s.capacity = 0;
    expect_error(KvCache::create(s), {"capacity must be >= 1", "found 0"});
    s = good;
    s.max_stage_rows = 0;
    expect_error(KvCache::create(s), {"max_stage_rows must be >= 1", "found 0"});
    s = good;
    s.layers[2].window = -1;
    expect_error(KvCache::create(s), {"layer 2", "window must be >= 0", "found -1"});
    s = good;
    s.layers[1].head_dim = 48;
    expect_error(KvCache::create(s), {"layer 1 K", "q8_0", "multiple of 32", "found 48"});
    s = good;
    s.k_format = KvFormat::kBf16;
    s.layers[3].head_dim = 16;
    expect_error(KvCache::create(s), {"layer 3 V", "q5_1", "multiple of 32", "found 16"});
    s = good;
    s.layers[0].n_kv_heads = 0;
    expect_error(KvCache::create(s), {"layer 0 K", "n_kv_heads 0"});
    s = good;
    s.capacity = INT64_MAX / 64;
    expect_error(KvCache::create(s), {"layer 0", "overflow"});
    expect_error(kv_cache_bytes(s), {"overflow"});
    // Unquantized formats accept any head_dim.
    s = good;
    s.k_format = KvFormat::kF32;
    s.v_format = KvFormat::kBf16;
    s.layers[1].head_dim = 7;
    EXPECT_TRUE(KvCache::create(s).has_value());
}

TEST(KvCacheSpec, LayoutAndMemoryEstimate) {
    auto spec = mixed_spec(KvFormat::kQ8_0, KvFormat::kQ5_1, 100, 4, 16, 5);
    auto layouts = kv_cache_layout(spec);
    ASSERT_TRUE(layouts.has_value());
    ASSERT_EQ(layouts->size(), 4u);
    // Layer 0: 2 x 64 values; q8_0 4 blocks x 34 B, q5_1 4 blocks x 24 B; 100 rows.
    EXPECT_EQ((*layouts)[0].row_elems, 128);
    EXPECT_EQ((*layouts)[0].k_row_bytes, 136);
    EXPECT_EQ((*layouts)[0].v_row_bytes, 96);
    EXPECT_EQ((*layouts)[0].slots, 100);
    // Layer 1: sliding, ring of window 16 + headroom 4.
    EXPECT_EQ((*layouts)[1].slots, 20);
    EXPECT_EQ((*layouts)[1].k_row_bytes, 34);
    EXPECT_EQ((*layouts)[1].window, 16);
    EXPECT_EQ((*layouts)[3].slots, 9);
    const int64_t want = 100 * (136 + 96) + 20 * (34 + 24) + 100 * (34 + 24) + 9 * (136 + 96);
    EXPECT_EQ(kv_cache_bytes(spec).value(), want);
    EXPECT_EQ(make_cache(spec).storage_bytes(), want);
    // A ring longer than the capacity is clipped to it.
    spec.capacity = 12;
    layouts = kv_cache_layout(spec);
    ASSERT_TRUE(layouts.has_value());
    EXPECT_EQ((*layouts)[1].slots, 12);
    EXPECT_EQ((*layouts)[3].slots, 9);
    EXPECT_EQ(make_cache(spec).storage_bytes(), kv_cache_bytes(spec).value());
}

// ---- Formats through the cache --------------------------------------------------------------------

// Every (K, V) format pair: staged rows (visible inside the transaction) and committed rows hold the
// reference encoder's bytes, and read() returns the reference decoder's floats.
TEST(KvCacheFormats, EveryFormatPairRoundTrips) {
    for (KvFormat kf : kFormats) {
        for (KvFormat vf : kFormats) {
            SCOPED_TRACE(std::string(kv_format_name(kf)) + "/" + kv_format_name(vf));
            KvCache cache = make_cache(mixed_spec(kf, vf, 16, 4));
            // Every live row of every layer.
            auto check_rows = [&] {
                for (int l = 0; l < cache.n_layers(); ++l) {
                    const int64_t p0 = cache.live_begin(l);
                    const int64_t p1 = cache.live_end(l);
                    const int64_t e = cache.layout(l).row_elems;
                    std::vector<float> k(static_cast<size_t>((p1 - p0) * e)), v(k.size());
                    ASSERT_TRUE(cache.read(l, p0, p1, k, v).has_value());
                    for (int64_t p = p0; p < p1; ++p) {
                        const auto kx = row_values(l, p, 0, false, e);
                        const auto vx = row_values(l, p, 0, true, e);
                        auto kb = cache.k_row_bytes(l, p);
                        auto vb = cache.v_row_bytes(l, p);
                        ASSERT_TRUE(kb && vb);
                        EXPECT_EQ(std::vector<std::byte>(kb->begin(), kb->end()), reference_encode(kf, kx));
                        EXPECT_EQ(std::vector<std::byte>(vb->begin(), vb->end()), reference_encode(vf, vx));
                        const auto at = static_cast<ptrdiff_t>((p - p0) * e);
                        EXPECT_TRUE(same_bits(std::vector<float>(k.begin() + at, k.begin() + at + e),
                                              reference_decode(kf, kx)));
                        EXPECT_TRUE(same_bits(std::vector<float>(v.begin() + at, v.begin() + at + e),
                                              reference_decode(vf, vx)));
                    }
                }
            };
            auto txn = cache.begin();
            ASSERT_TRUE(txn.has_value());
            stage_all(cache, *txn, 3, 0);
            EXPECT_EQ(cache.live_end(1), 3);
            check_rows();
            ASSERT_TRUE(cache.commit(*txn, 3).has_value());
            EXPECT_EQ(cache.live_begin(0), 0);
            EXPECT_EQ(cache.live_begin(1), 1);  // window 2 keeps positions 1, 2
            EXPECT_EQ(cache.live_end(1), 3);
            check_rows();
        }
    }
}

// ---- Refusals -------------------------------------------------------------------------------------

TEST(KvCacheTxn, TransactionRefusalsLeaveStateUnchanged) {
    KvCache cache = make_cache(mixed_spec(KvFormat::kQ8_0, KvFormat::kQ5_1, 8, 3));
    test::run_straight(cache, 2, 2);
    auto t1 = cache.begin();
    ASSERT_TRUE(t1.has_value());
    EXPECT_EQ(t1->generation, 2u);
    EXPECT_EQ(t1->base, 2);
    stage_all(cache, *t1, 1, 7);
    const Snapshot before = snapshot(cache);
    const uint64_t digest = kv_cache_digest(cache);
    auto unchanged = [&] {
        EXPECT_TRUE(snapshot(cache) == before);
        EXPECT_EQ(kv_cache_digest(cache), digest);
        EXPECT_TRUE(cache.in_txn());
        EXPECT_EQ(cache.last_generation(), 2u);
    };

    expect_error(cache.begin(), {"begin", "generation 2 is still open"});
    unchanged();
    std::vector<float> none;
    expect_error(cache.stage(*t1, 4, none, none, 1), {"stage", "layer 4 is out of range [0, 4)"});
    expect_error(cache.stage(*t1, -1, none, none, 1), {"layer -1 is out of range"});
    expect_error(cache.stage(*t1, 0, none, none, -1), {"layer 0", "row count must be >= 0", "found -1"});
    // Headroom is per transaction: 1 staged + 3 more > 3.
    expect_error(stage_rows(cache, *t1, 0, 3, 3, 0), {"layer 0", "1 + 3 staged rows exceed max_stage_rows 3"});
    // Span sizes must match n rows exactly.
    std::vector<float> short_k(64), full_v(128);
    expect_error(cache.stage(*t1, 0, short_k, full_v, 1), {"layer 0", "expected 128 values", "found K 64 V 128"});
    unchanged();
    // Commit: layers must agree, n within [0, staged].
    expect_error(cache.commit(*t1, 2), {"commit", "row count 2 is outside [0, 1]"});
    expect_error(cache.commit(*t1, -1), {"row count -1 is outside [0, 1]"});
    ASSERT_TRUE(stage_rows(cache, *t1, 1, 3, 1, 7).has_value());
    expect_error(cache.commit(*t1, 1), {"layers staged different row counts", "layer 0: 1", "layer 1: 2"});
    EXPECT_TRUE(cache.in_txn());
    // A forged handle: right generation, wrong base.
    expect_error(cache.commit(KvTxn{t1->generation, t1->base + 1}, 0), {"generation 2 has base 3", "length 2"});
    expect_error(cache.rollback(KvTxn{99, 2}), {"rollback", "generation 99 was never begun", "last generation 2"});
    expect_error(cache.rollback(KvTxn{}), {"generation 0 was never begun"});
    EXPECT_TRUE(cache.in_txn());

    // A stale handle while a newer transaction is open; finished handles afterwards.
    ASSERT_TRUE(cache.rollback(*t1).has_value());
    expect_error(cache.rollback(*t1), {"rollback", "generation 2 is already finished"});
    expect_error(cache.commit(*t1, 0), {"commit", "generation 2 is already finished"});
    auto t2 = cache.begin();
    ASSERT_TRUE(t2.has_value());
    EXPECT_EQ(t2->generation, 3u);
    expect_error(stage_rows(cache, *t1, 0, 2, 1, 0), {"stage", "stale transaction generation 2", "generation 3"});
    expect_error(cache.commit(*t1, 0), {"commit", "stale transaction generation 2"});
    expect_error(cache.rollback(*t1), {"rollback", "stale transaction generation 2"});
    EXPECT_EQ(cache.staged(0), 0);
    ASSERT_TRUE(cache.commit(*t2, 0).has_value());  // an empty commit closes the transaction
    EXPECT_FALSE(cache.in_txn());
    EXPECT_EQ(cache.length(), 2);
    expect_error(cache.commit(*t2, 0), {"generation 3 is already finished"});
}

TEST(KvCacheTxn, StagingPastCapacityIsRefused) {
    KvCache cache = make_cache(mixed_spec(KvFormat::kF32, KvFormat::kBf16, 5, 4));
    test::run_straight(cache, 3, 3);
    auto txn = cache.begin();
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(stage_rows(cache, *txn, 0, 3, 1, 0).has_value());
    expect_error(stage_rows(cache, *txn, 0, 4, 2, 0), {"layer 0", "positions [4, 6) reach past capacity 5"});
    // Sliding layers count positions against the same capacity.
    expect_error(stage_rows(cache, *txn, 1, 3, 3, 0), {"layer 1", "positions [3, 6) reach past capacity 5"});
    EXPECT_EQ(cache.staged(0), 1);
    EXPECT_EQ(cache.staged(1), 0);
    ASSERT_TRUE(stage_rows(cache, *txn, 0, 4, 1, 0).has_value());
    for (int l = 1; l < 4; ++l) ASSERT_TRUE(stage_rows(cache, *txn, l, 3, 2, 0).has_value());
    ASSERT_TRUE(cache.commit(*txn, 2).has_value());
    EXPECT_EQ(cache.length(), 5);
    txn = cache.begin();
    ASSERT_TRUE(txn.has_value());
    expect_error(stage_rows(cache, *txn, 2, 5, 1, 0), {"positions [5, 6) reach past capacity 5"});
}

TEST(KvCacheRead, RefusesPositionsThatAreNotLive) {
    KvCache cache = make_cache(mixed_spec(KvFormat::kQ8_0, KvFormat::kQ5_1, 16, 3));
    test::run_straight(cache, 6, 3);
    auto txn = cache.begin();
    ASSERT_TRUE(txn.has_value());
    ASSERT_TRUE(stage_rows(cache, *txn, 1, 6, 2, 0).has_value());
    // Layer 1 (window 2): live [4, 8) = committed window + 2 staged; layer 0 (full): [0, 6).
    EXPECT_EQ(cache.live_begin(1), 4);
    EXPECT_EQ(cache.live_end(1), 8);
    EXPECT_EQ(cache.live_begin(0), 0);
    EXPECT_EQ(cache.live_end(0), 6);
    std::vector<float> k(32 * 4), v(32 * 4);
    EXPECT_TRUE(cache.read(1, 4, 8, k, v).has_value());
    expect_error(cache.read(1, 3, 7, k, v),
                 {"read", "layer 1 positions [3, 7) are not live", "live positions are [4, 8)", "window 2",
                  "committed 6", "staged 2"});
    expect_error(cache.read(1, 5, 9, k, v), {"positions [5, 9) are not live"});
    expect_error(cache.read(1, 6, 5, k, v), {"positions [6, 5) are not live"});
    std::vector<float> k0(128), v0(128);
    expect_error(cache.read(0, 6, 7, k0, v0), {"layer 0 positions [6, 7) are not live", "[0, 6)"});
    expect_error(cache.read(9, 0, 1, k0, v0), {"read", "layer 9 is out of range"});
    std::vector<float> k_small(100);
    expect_error(cache.read(1, 4, 8, k_small, v), {"read", "layer 1", "expected output buffers of 128 values",
                                                   "found K 100 V 128"});
    std::vector<float> empty;
    EXPECT_TRUE(cache.read(1, 5, 5, empty, empty).has_value());
    expect_error(cache.k_row_bytes(1, 3), {"k_row_bytes", "layer 1 positions [3, 4) are not live"});
    expect_error(cache.v_row_bytes(0, 6), {"v_row_bytes", "layer 0 positions [6, 7) are not live"});
    EXPECT_TRUE(cache.k_row_bytes(1, 7).has_value());
    // After a rollback the staged rows are gone again.
    ASSERT_TRUE(cache.rollback(*txn).has_value());
    expect_error(cache.k_row_bytes(1, 6), {"not live", "live positions are [4, 6)"});
}

// ---- The seed TP gate's transaction walk, as unit tests --------------------------------------------

// Three tokens through a capacity-3 cache: commit 1; stage 2 and commit 1 (partial); stage, roll back;
// stage again and commit (recommit). Cache bytes after the partial commit equal those after the
// rollback; the final bytes equal a run that never speculated; reads of the speculative, rolled-back and
// recommitted rows are bit-identical; generations are 1, 2, 3, 4; grow keeps bytes and the counter.
TEST(KvCacheGate, ThreeStepsPartialCommitRollbackRecommit) {
    for (KvFormat kf : kFormats) {
        for (KvFormat vf : {KvFormat::kQ5_1, KvFormat::kBf16}) {
            SCOPED_TRACE(std::string(kv_format_name(kf)) + "/" + kv_format_name(vf));
            KvCacheSpec spec;
            spec.layers = {{2, 64, 0}, {1, 64, 2}};
            spec.k_format = kf;
            spec.v_format = vf;
            spec.capacity = 3;
            spec.max_stage_rows = 2;
            KvCache cache = make_cache(spec);
            auto state = [&](int64_t committed, int64_t staged) {
                EXPECT_EQ(cache.length(), committed);
                for (int l = 0; l < cache.n_layers(); ++l) {
                    EXPECT_EQ(cache.staged(l), staged);
                    EXPECT_EQ(cache.live_end(l), committed + staged);
                }
            };
            // The rows of position 2 as attention would see them inside a transaction.
            auto read_pos2 = [&](int layer) {
                const int64_t e = cache.layout(layer).row_elems;
                std::vector<float> k(e), v(e);
                EXPECT_TRUE(cache.read(layer, 2, 3, k, v).has_value());
                k.insert(k.end(), v.begin(), v.end());
                return k;
            };

            auto first = cache.begin();
            ASSERT_TRUE(first.has_value());
            stage_all(cache, *first, 1, 0);
            state(0, 1);
            ASSERT_TRUE(cache.commit(*first, 1).has_value());
            state(1, 0);
            expect_error(cache.commit(*first, 1), {"already finished"});

            auto partial = cache.begin();
            ASSERT_TRUE(partial.has_value());
            expect_error(cache.begin(), {"still open"});
            stage_all(cache, *partial, 1, 0);
            stage_all(cache, *partial, 1, 0);  // the speculative token
            state(1, 2);
            const auto speculative = read_pos2(0);
            const auto speculative_swa = read_pos2(1);
            ASSERT_TRUE(cache.commit(*partial, 1).has_value());
            state(2, 0);
            const Snapshot partial_cache = snapshot(cache);

            auto rollback = cache.begin();
            ASSERT_TRUE(rollback.has_value());
            stage_all(cache, *rollback, 1, 0);
            state(2, 1);
            const auto rolled_back = read_pos2(0);
            const auto rolled_back_swa = read_pos2(1);
            ASSERT_TRUE(cache.rollback(*rollback).has_value());
            state(2, 0);
            expect_error(cache.rollback(*rollback), {"already finished"});
            const Snapshot rollback_cache = snapshot(cache);
            EXPECT_TRUE(partial_cache == rollback_cache);

            auto recommit = cache.begin();
            ASSERT_TRUE(recommit.has_value());
            stage_all(cache, *recommit, 1, 0);
            state(2, 1);
            const auto recommitted = read_pos2(0);
            const auto recommitted_swa = read_pos2(1);
            ASSERT_TRUE(cache.commit(*recommit, 1).has_value());
            state(3, 0);
            const Snapshot final_cache = snapshot(cache);

            EXPECT_TRUE(same_bits(speculative, rolled_back));
            EXPECT_TRUE(same_bits(rolled_back, recommitted));
            EXPECT_TRUE(same_bits(speculative_swa, recommitted_swa));
            EXPECT_TRUE(same_bits(rolled_back_swa, recommitted_swa));
            const uint64_t generations[] = {first->generation, partial->generation, rollback->generation,
                                            recommit->generation};
            EXPECT_EQ(std::vector<uint64_t>(std::begin(generations), std::end(generations)),
                      (std::vector<uint64_t>{1, 2, 3, 4}));

            KvCache straight = make_cache(spec);
            test::run_straight(straight, 3, 2);
            EXPECT_TRUE(snapshot(straight) == final_cache);
            EXPECT_EQ(kv_cache_digest(straight), kv_cache_digest(cache));

            // Grow by 5: same bytes, the next transaction is generation 5 at base 3.
            ASSERT_TRUE(cache.grow(8).has_value());
            EXPECT_EQ(cache.capacity(), 8);
            EXPECT_TRUE(snapshot(cache) == final_cache);
            auto next = cache.begin();
            ASSERT_TRUE(next.has_value());
            EXPECT_EQ(next->generation, 5u);
            EXPECT_EQ(next->base, 3);
            ASSERT_TRUE(cache.rollback(*next).has_value());
            state(3, 0);
        }
    }
}

// D7: after a committed prefix, stage 5 rows and commit 2; stage 3 draft rows (different values) and
// roll back; stage the 3 true rows and commit 3. Every layer's bytes equal a straight run of 5 rows,
// for every format pair, including sliding rings that wrap during the walk.
TEST(KvCacheGate, SpeculationEqualsAStraightRunByteForByte) {
    for (KvFormat kf : kFormats) {
        for (KvFormat vf : kFormats) {
            SCOPED_TRACE(std::string(kv_format_name(kf)) + "/" + kv_format_name(vf));
            const KvCacheSpec spec = mixed_spec(kf, vf, 64, 5);  // rings of 2 + 5 and 3 + 5 slots
            KvCache spec_run = make_cache(spec);
            KvCache straight = make_cache(spec);
            KvCache wrong = make_cache(spec);  // negative control: commits its draft instead
            for (KvCache *c : {&spec_run, &straight, &wrong}) test::run_straight(*c, 20, 5);

            auto t = straight.begin();
            stage_all(straight, *t, 5, 0);
            ASSERT_TRUE(straight.commit(*t, 5).has_value());

            for (KvCache *c : {&spec_run, &wrong}) {
                t = c->begin();
                stage_all(*c, *t, 5, 0);
                ASSERT_TRUE(c->commit(*t, 2).has_value());
                t = c->begin();
                stage_all(*c, *t, 3, 1234);  // a draft whose rows differ
                if (c == &wrong) {
                    ASSERT_TRUE(c->commit(*t, 3).has_value());
                    continue;
                }
                ASSERT_TRUE(c->rollback(*t).has_value());
                t = c->begin();
                stage_all(*c, *t, 3, 0);
                ASSERT_TRUE(c->commit(*t, 3).has_value());
            }
            EXPECT_EQ(spec_run.length(), 25);
            EXPECT_TRUE(snapshot(spec_run) == snapshot(straight));
            EXPECT_EQ(kv_cache_digest(spec_run), kv_cache_digest(straight));
            // The comparison can fail: the run that kept its draft differs in bytes and digest.
            EXPECT_FALSE(snapshot(wrong) == snapshot(straight));
            EXPECT_NE(kv_cache_digest(wrong), kv_cache_digest(straight));
        }
    }
}

TEST(KvCacheTxn, GenerationsStrictlyIncrease) {
    KvCache cache = make_cache(mixed_spec(KvFormat::kQ8_0, KvFormat::kQ5_1, 40, 3));
    std::mt19937 rng(5);
    uint64_t previous = 0;
    for (int step = 0; step < 60; ++step) {
        auto txn = cache.begin();
        ASSERT_TRUE(txn.has_value());
        EXPECT_EQ(txn->generation, previous + 1);
        EXPECT_EQ(txn->base, cache.length());
        EXPECT_EQ(cache.last_generation(), txn->generation);
        previous = txn->generation;
        const int64_t room = std::min<int64_t>(3, cache.capacity() - cache.length());
        const int64_t n = room == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint32_t>(room + 1));
        stage_all(cache, *txn, n, 0);
        if (rng() % 2) {
            ASSERT_TRUE(cache.commit(*txn, n > 0 ? n - 1 : 0).has_value());
        } else {
            ASSERT_TRUE(cache.rollback(*txn).has_value());
        }
        if (step == 30) {
            ASSERT_TRUE(cache.grow(80).has_value());
        }
    }
    EXPECT_EQ(cache.last_generation(), 60u);
}

// ---- Growth ----------------------------------------------------------------------------------------

TEST(KvCacheGrow, PreservesBytesAndRefusesWhileOpenOrShrinking) {
    for (KvFormat f : kFormats) {
        SCOPED_TRACE(kv_format_name(f));
        // Window 8 + headroom 3 is clipped to capacity 6, so the ring re-slots when it grows; window 2 +
        // headroom 3 = 5 slots has wrapped and keeps its size.
        KvCacheSpec spec = mixed_spec(f, KvFormat::kQ8_0, 6, 3, 8, 2);
        KvCache cache = make_cache(spec);
        test::run_straight(cache, 6, 3);
        const Snapshot before = snapshot(cache);
        const uint64_t digest = kv_cache_digest(cache);

        auto txn = cache.begin();
        ASSERT_TRUE(txn.has_value());
        expect_error(cache.grow(20), {"grow", "transaction generation 3 is open", "commit or roll it back"});
        ASSERT_TRUE(cache.rollback(*txn).has_value());
        expect_error(cache.grow(5), {"grow", "new capacity 5 is below the current capacity 6"});
        EXPECT_TRUE(cache.grow(6).has_value());  // equal: a no-op
        EXPECT_EQ(cache.capacity(), 6);

        ASSERT_TRUE(cache.grow(40).has_value());
        EXPECT_EQ(cache.capacity(), 40);
        EXPECT_EQ(cache.length(), 6);
        EXPECT_EQ(cache.layout(0).slots, 40);
        EXPECT_EQ(cache.layout(1).slots, 11);
        EXPECT_EQ(cache.layout(3).slots, 5);
        EXPECT_TRUE(snapshot(cache) == before);
        EXPECT_EQ(kv_cache_digest(cache), digest);
        spec.capacity = 40;
        EXPECT_EQ(cache.storage_bytes(), kv_cache_bytes(spec).value());

        // The grown cache continues exactly like one created at the larger capacity.
        test::run_straight(cache, 30, 3);
        KvCache fresh = make_cache(spec);
        test::run_straight(fresh, 36, 3);
        EXPECT_TRUE(snapshot(cache) == snapshot(fresh));
        EXPECT_EQ(kv_cache_digest(cache), kv_cache_digest(fresh));
    }
}

// ---- Sliding rings ---------------------------------------------------------------------------------

// Stage the maximum (headroom) rows in every layer, then roll back, or commit only part: every committed
// row of every window reads back bit-identically, before and after.
TEST(KvCacheRing, MaxStageRollbackNeverDestroysALiveRow) {
    const int kHeadroom = 4;
    KvCacheSpec spec = mixed_spec(KvFormat::kQ8_0, KvFormat::kQ5_1, 100, kHeadroom, 4, 1);
    KvCache cache = make_cache(spec);
    test::run_straight(cache, 30, 4);
    const Snapshot committed = snapshot(cache);

    auto txn = cache.begin();
    ASSERT_TRUE(txn.has_value());
    stage_all(cache, *txn, kHeadroom, 99);
    // While staged, the committed window is intact: only positions below length - window were overwritten.
    Snapshot during = snapshot(cache);
    for (int l = 0; l < cache.n_layers(); ++l) {
        EXPECT_EQ(during.live_begin[l], committed.live_begin[l]);
        during.k[l].resize(committed.k[l].size());
        during.v[l].resize(committed.v[l].size());
        during.live_end[l] = committed.live_end[l];
    }
    EXPECT_TRUE(during == committed);
    ASSERT_TRUE(cache.rollback(*txn).has_value());
    EXPECT_TRUE(snapshot(cache) == committed);

    // Partial commit of 1 row: the window slides by one; the rest of it is the old bytes.
    txn = cache.begin();
    stage_all(cache, *txn, kHeadroom, 77);
    ASSERT_TRUE(cache.commit(*txn, 1).has_value());
    const Snapshot after = snapshot(cache);
    ASSERT_EQ(after.live_begin[1], 27);  // window 4 over length 31
    for (int64_t p = 27; p < 30; ++p) {
        EXPECT_EQ(after.k[1][p - 27], committed.k[1][p - 26]);
        EXPECT_EQ(after.v[1][p - 27], committed.v[1][p - 26]);
    }
    ASSERT_EQ(after.live_begin[3], 30);  // window 1: only the new row
    const auto want = reference_encode(KvFormat::kQ8_0, row_values(3, 30, 77, false, 128));
    EXPECT_EQ(after.k[3][0], want);
}

// Long randomized runs: 1..headroom rows per transaction (sometimes in two stage calls), random partial
// commits and rollbacks with rows that differ from attempt to attempt. After every transaction, and for
// the staged rows inside it, every live row of every layer equals a plain reference of all rows.
TEST(KvCacheRing, LongRunsMatchAReferenceOfAllRows) {
    const std::pair<KvFormat, KvFormat> pairs[] = {{KvFormat::kQ8_0, KvFormat::kQ5_1},
                                                   {KvFormat::kF32, KvFormat::kBf16}};
    for (auto [kf, vf] : pairs) {
        SCOPED_TRACE(std::string(kv_format_name(kf)) + "/" + kv_format_name(vf));
        const int kHeadroom = 6;
        KvCacheSpec spec;
        spec.layers = {{1, 32, 0}, {2, 32, 16}, {1, 64, 5}, {1, 32, 1}};
        spec.k_format = kf;
        spec.v_format = vf;
        spec.capacity = 210;
        spec.max_stage_rows = kHeadroom;
        KvCache cache = make_cache(spec);
        const int n_layers = static_cast<int>(spec.layers.size());
        // reference[layer][pos] = the values committed at pos (K then V salt recorded by position).
        std::vector<uint64_t> salt_of;  // salt of the committed row at each position (same for all layers)
        std::mt19937 rng(11);

        auto check_layer = [&](int l, uint64_t staged_salt) {
            const int64_t e = cache.layout(l).row_elems;
            const int64_t window = spec.layers[l].window;
            const int64_t lo = window == 0 ? 0 : std::max<int64_t>(0, cache.length() - window);
            ASSERT_EQ(cache.live_begin(l), lo);
            const int64_t hi = cache.live_end(l);
            std::vector<float> k(static_cast<size_t>((hi - lo) * e)), v(k.size());
            ASSERT_TRUE(cache.read(l, lo, hi, k, v).has_value());
            for (int64_t p = lo; p < hi; ++p) {
                const uint64_t salt = p < cache.length() ? salt_of[p] : staged_salt;
                const auto kx = row_values(l, p, salt, false, e);
                const auto vx = row_values(l, p, salt, true, e);
                auto kb = cache.k_row_bytes(l, p);
                auto vb = cache.v_row_bytes(l, p);
                ASSERT_TRUE(kb && vb);
                ASSERT_EQ(std::vector<std::byte>(kb->begin(), kb->end()), reference_encode(kf, kx)) << "pos " << p;
                ASSERT_EQ(std::vector<std::byte>(vb->begin(), vb->end()), reference_encode(vf, vx)) << "pos " << p;
                const auto at = static_cast<ptrdiff_t>((p - lo) * e);
                const std::vector<float> k_row(k.begin() + at, k.begin() + at + e);
                const std::vector<float> v_row(v.begin() + at, v.begin() + at + e);
                ASSERT_TRUE(same_bits(k_row, reference_decode(kf, kx))) << "pos " << p;
                ASSERT_TRUE(same_bits(v_row, reference_decode(vf, vx))) << "pos " << p;
            }
            if (lo > 0) {
                EXPECT_FALSE(cache.k_row_bytes(l, lo - 1).has_value());
            }
        };

        int rollbacks = 0, partials = 0;
        while (cache.length() < 200) {
            auto txn = cache.begin();
            ASSERT_TRUE(txn.has_value());
            const uint64_t salt = txn->generation;  // every attempt writes different values
            const int64_t s = 1 + static_cast<int64_t>(rng() % kHeadroom);
            const int64_t first = 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(s));
            for (int l = 0; l < n_layers; ++l) {
                ASSERT_TRUE(stage_rows(cache, *txn, l, cache.length(), first, salt).has_value());
                if (first < s) {
                    ASSERT_TRUE(stage_rows(cache, *txn, l, cache.length() + first, s - first, salt).has_value());
                }
            }
            for (int l = 0; l < n_layers; ++l) check_layer(l, salt);
            const uint32_t action = rng() % 4;
            if (action == 0) {
                ASSERT_TRUE(cache.rollback(*txn).has_value());
                ++rollbacks;
            } else {
                const int64_t n = action == 1 ? static_cast<int64_t>(rng() % static_cast<uint32_t>(s + 1)) : s;
                partials += n < s ? 1 : 0;
                ASSERT_TRUE(cache.commit(*txn, n).has_value());
                for (int64_t i = 0; i < n; ++i) salt_of.push_back(salt);
            }
            ASSERT_EQ(cache.length(), static_cast<int64_t>(salt_of.size()));
            for (int l = 0; l < n_layers; ++l) check_layer(l, 0);
        }
        EXPECT_GT(rollbacks, 10);
        EXPECT_GT(partials, 5);
    }
}

// ---- Digest ----------------------------------------------------------------------------------------

TEST(KvCacheDigest, SeesEveryLiveRowAndTheStagedState) {
    const KvCacheSpec spec = mixed_spec(KvFormat::kQ8_0, KvFormat::kQ5_1, 16, 3);
    KvCache a = make_cache(spec);
    KvCache b = make_cache(spec);
    test::run_straight(a, 6, 3);
    test::run_straight(b, 6, 3);
    EXPECT_EQ(kv_cache_digest(a), kv_cache_digest(b));
    // One different V row in one layer changes it.
    for (KvCache *c : {&a, &b}) {
        auto t = c->begin();
        for (int l = 0; l < 4; ++l) {
            ASSERT_TRUE(stage_rows(*c, *t, l, 6, 1, (c == &b && l == 2) ? 1 : 0).has_value());
        }
        ASSERT_TRUE(c->commit(*t, 1).has_value());
    }
    EXPECT_NE(kv_cache_digest(a), kv_cache_digest(b));
    // Open staging is part of the state.
    KvCache c = make_cache(spec);
    test::run_straight(c, 6, 3);
    const uint64_t committed = kv_cache_digest(c);
    auto t = c.begin();
    EXPECT_EQ(kv_cache_digest(c), committed);  // an open, empty transaction stages nothing
    stage_all(c, *t, 1, 0);
    EXPECT_NE(kv_cache_digest(c), committed);
    ASSERT_TRUE(c.rollback(*t).has_value());
    EXPECT_EQ(kv_cache_digest(c), committed);
}

}  // namespace
}  // namespace memra::kv
