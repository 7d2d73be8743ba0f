// Tests for the in-process communicator: byte-exact all-gather (in place too), broadcast and send/recv at
// many rank counts, barrier ordering, a long seeded run of mixed operations, every mismatch and bad
// argument with its message on every rank it concerns, abort, deadlock and failing-rank release, no heap
// allocation on the steady-state path, and the measured cost of a 4 KiB all-gather.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "parallel/comm.h"

#include "alloc_counter.h"

namespace memra::parallel {
namespace {

using Bytes = std::vector<std::byte>;

// A byte that differs with the rank, the operation and the position, so a byte landing in the wrong slot,
// from the wrong operation or at the wrong offset is caught.
std::byte pattern(int rank, int64_t op, size_t i) {
    uint64_t x = static_cast<uint64_t>(rank + 1) * 0x9E3779B97F4A7C15ull;
    x ^= static_cast<uint64_t>(op + 1) * 0xBF58476D1CE4E5B9ull;
    x ^= static_cast<uint64_t>(i + 1) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    return static_cast<std::byte>(x & 0xff);
}

void fill(std::span<std::byte> s, int rank, int64_t op) {
    for (size_t i = 0; i < s.size(); ++i) s[i] = pattern(rank, op, i);
}

// Returns an error naming the first byte that is not pattern(rank, op, i).
Result<void> expect_pattern(std::span<const std::byte> got, int rank, int64_t op, const char *what) {
    for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != pattern(rank, op, i)) {
            return make_error("{} (op {}): byte {} is {}, expected {} from rank {}", what, op, i,
                              static_cast<int>(got[i]), static_cast<int>(pattern(rank, op, i)), rank);
        }
    }
    return {};
}

Result<void> check_all_gather(Communicator &comm, size_t bytes, int64_t op, bool in_place) {
    const int n = comm.size();
    const int me = comm.rank();
    Bytes recv(static_cast<size_t>(n) * bytes, std::byte{0xEE});
    Bytes send(bytes);
    std::span<std::byte> own = std::span(recv).subspan(static_cast<size_t>(me) * bytes, bytes);
    fill(in_place ? own : std::span<std::byte>(send), me, op);
    const std::span<const std::byte> src =
        in_place ? std::span<const std::byte>(own) : std::span<const std::byte>(send);
    if (auto ok = comm.all_gather(src, recv); !ok) return ok;
    for (int r = 0; r < n; ++r) {
        auto slot = std::span<const std::byte>(recv).subspan(static_cast<size_t>(r) * bytes, bytes);
        if (auto ok = expect_pattern(slot, r, op, "all_gather slot"); !ok) return ok;
    }
    return {};
}

// Runs one rank function per rank and returns each rank's message ("" on success); the run itself must
// succeed because every rank reports through `messages`.
std::vector<std::string> messages_of(int n, const std::function<Result<void>(int, Communicator &)> &fn) {
    std::vector<std::string> messages(static_cast<size_t>(n));
    auto run = run_ranks(n, [&](int rank, Communicator &comm) -> Result<void> {
        auto r = fn(rank, comm);
        if (!r) messages[static_cast<size_t>(rank)] = r.error().message;
        return {};
    });
    EXPECT_TRUE(run.has_value()) << run.error().message;
    return messages;
}

// ---- Collectives ----

TEST(Comm, AllGatherIsByteExactForOneToEightRanks) {
    for (int n = 1; n <= 8; ++n) {
        auto run = run_ranks(n, [](int, Communicator &comm) -> Result<void> {
            int64_t op = 0;
            for (size_t bytes : {size_t{0}, size_t{1}, size_t{7}, size_t{64}, size_t{1000}, size_t{4096}}) {
                for (bool in_place : {false, true}) {
                    if (auto ok = check_all_gather(comm, bytes, op++, in_place); !ok) return ok;
                }
            }
            return {};
        });
        EXPECT_TRUE(run.has_value()) << "n=" << n << ": " << run.error().message;
    }
}

// Bytes copied through the group's ByteCopy (the device copy of ranks sharing a GPU): every transfer of an
// all-gather, a broadcast and a send/recv goes through it, and the results stay byte-exact.
std::atomic<int64_t> g_copied_bytes{0};
void counting_copy(void *dst, const void *src, size_t n) {
    g_copied_bytes += static_cast<int64_t>(n);
    std::memcpy(dst, src, n);
}

TEST(Comm, EveryTransferGoesThroughTheGroupsByteCopy) {
    g_copied_bytes = 0;
    auto group = InProcessGroup::create(3, counting_copy);
    ASSERT_TRUE(group.has_value()) << group.error().message;
    auto run = group->run([](int rank, Communicator &comm) -> Result<void> {
        if (auto ok = check_all_gather(comm, 100, 0, false); !ok) return ok;
        std::array<std::byte, 10> buf{};
        if (rank == 1) buf.fill(std::byte{7});
        if (auto ok = comm.broadcast(buf, 1); !ok) return ok;
        if (buf[9] != std::byte{7}) return make_error("rank {}: broadcast lost its bytes", rank);
        std::array<std::byte, 5> msg{};
        if (rank == 0) {
            msg.fill(std::byte{3});
            return comm.send(msg, 2);
        }
        if (rank == 2) {
            if (auto ok = comm.recv(msg, 0); !ok) return ok;
            if (msg[4] != std::byte{3}) return make_error("recv lost its bytes");
        }
        return {};
    });
    ASSERT_TRUE(run.has_value()) << run.error().message;
    // all-gather: 3 ranks x 3 slots of 100 bytes; broadcast: 2 non-root ranks x 10; send/recv: 5.
    EXPECT_EQ(g_copied_bytes.load(), 3 * 300 + 2 * 10 + 5);
}

TEST(Comm, BroadcastFromEveryRoot) {
    for (int n : {1, 2, 3, 5, 8}) {
        auto run = run_ranks(n, [](int me, Communicator &comm) -> Result<void> {
            int64_t op = 0;
            for (int root = 0; root < comm.size(); ++root) {
                for (size_t bytes : {size_t{0}, size_t{3}, size_t{4096}}) {
                    Bytes buf(bytes);
                    fill(buf, me == root ? root : 100 + me, op);  // non-roots start with their own bytes
                    if (auto ok = comm.broadcast(buf, root); !ok) return ok;
                    if (auto ok = expect_pattern(buf, root, op, "broadcast"); !ok) return ok;
                    ++op;
                }
            }
            return {};
        });
        EXPECT_TRUE(run.has_value()) << "n=" << n << ": " << run.error().message;
    }
}

TEST(Comm, BarrierReleasesNoRankBeforeAllArrive) {
    constexpr int kRounds = 40;
    for (int n : {2, 3, 8}) {
        std::atomic<int> arrivals{0};
        auto run = run_ranks(n, [&](int me, Communicator &comm) -> Result<void> {
            for (int round = 0; round < kRounds; ++round) {
                // One late rank per round: a barrier that let anyone through early would see it missing.
                if (me == round % n) std::this_thread::sleep_for(std::chrono::microseconds(200));
                arrivals.fetch_add(1);
                if (auto ok = comm.barrier(); !ok) return ok;
                const int seen = arrivals.load();
                // Everyone's arrival for this round, and nobody past the next barrier.
                if (seen < n * (round + 1) || seen > n * (round + 2)) {
                    return make_error("round {}: {} arrivals after the barrier, expected {} to {}", round, seen,
                                      n * (round + 1), n * (round + 2));
                }
            }
            return {};
        });
        EXPECT_TRUE(run.has_value()) << "n=" << n << ": " << run.error().message;
    }
}

// ---- Send / recv ----

TEST(Comm, RingShiftInOneGroupPerRank) {
    for (int n = 2; n <= 8; ++n) {
        auto run = run_ranks(n, [](int me, Communicator &comm) -> Result<void> {
            const int n_ranks = comm.size();
            const int next = (me + 1) % n_ranks;
            const int prev = (me + n_ranks - 1) % n_ranks;
            for (int64_t round = 0; round < 5; ++round) {
                const size_t bytes = static_cast<size_t>(1 + 37 * round);
                Bytes out(bytes), in(bytes, std::byte{0});
                fill(out, me, round);
                if (auto ok = comm.group_start(); !ok) return ok;
                if (auto ok = comm.send(out, next); !ok) return ok;
                if (auto ok = comm.recv(in, prev); !ok) return ok;
                if (auto ok = comm.group_end(); !ok) return ok;
                if (auto ok = expect_pattern(in, prev, round, "ring recv"); !ok) return ok;
            }
            return {};
        });
        EXPECT_TRUE(run.has_value()) << "n=" << n << ": " << run.error().message;
    }
}

TEST(Comm, PairwiseExchangeGroupedAndOrdered) {
    auto run = run_ranks(6, [](int me, Communicator &comm) -> Result<void> {
        const int peer = me ^ 1;
        Bytes out(300), in(300);
        // Grouped: both sides send first.
        fill(out, me, 0);
        if (auto ok = comm.group_start(); !ok) return ok;
        if (auto ok = comm.send(out, peer); !ok) return ok;
        if (auto ok = comm.recv(in, peer); !ok) return ok;
        if (auto ok = comm.group_end(); !ok) return ok;
        if (auto ok = expect_pattern(in, peer, 0, "grouped exchange"); !ok) return ok;
        // Ungrouped: the even rank sends first, the odd one receives first.
        fill(out, me, 1);
        if (me % 2 == 0) {
            if (auto ok = comm.send(out, peer); !ok) return ok;
            if (auto ok = comm.recv(in, peer); !ok) return ok;
        } else {
            if (auto ok = comm.recv(in, peer); !ok) return ok;
            if (auto ok = comm.send(out, peer); !ok) return ok;
        }
        return expect_pattern(in, peer, 1, "ordered exchange");
    });
    EXPECT_TRUE(run.has_value()) << run.error().message;
}

TEST(Comm, SendRecvMatchInFifoOrderPerPair) {
    // Rank 0 sends three messages of different sizes to rank 2 in one group while rank 1 also sends to
    // rank 2; rank 2 takes rank 1's first, then rank 0's one by one.
    auto run = run_ranks(3, [](int me, Communicator &comm) -> Result<void> {
        if (me == 0) {
            std::vector<Bytes> out;
            for (int64_t k = 0; k < 3; ++k) {
                out.emplace_back(static_cast<size_t>(10 + k));
                fill(out.back(), 0, k);
            }
            if (auto ok = comm.group_start(); !ok) return ok;
            for (const Bytes &b : out) {
                if (auto ok = comm.send(b, 2); !ok) return ok;
            }
            return comm.group_end();
        }
        if (me == 1) {
            Bytes out(5);
            fill(out, 1, 7);
            return comm.send(out, 2);
        }
        Bytes from1(5);
        if (auto ok = comm.recv(from1, 1); !ok) return ok;
        if (auto ok = expect_pattern(from1, 1, 7, "recv from 1"); !ok) return ok;
        for (int64_t k = 0; k < 3; ++k) {
            Bytes in(static_cast<size_t>(10 + k));
            if (auto ok = comm.recv(in, 0); !ok) return ok;
            if (auto ok = expect_pattern(in, 0, k, "fifo recv from 0"); !ok) return ok;
        }
        return {};
    });
    EXPECT_TRUE(run.has_value()) << run.error().message;
}

// ---- A long seeded mix ----

TEST(Comm, ThousandMixedOperationsWithRandomSizes) {
    for (int n : {3, 4}) {
        auto run = run_ranks(n, [](int me, Communicator &comm) -> Result<void> {
            const int n_ranks = comm.size();
            std::mt19937 rng(1234);  // the same stream on every rank, so all agree on each operation
            Bytes recv, send, buf;
            for (int64_t op = 0; op < 1000; ++op) {
                const auto kind = static_cast<uint32_t>(rng() % 5);
                const auto bytes = static_cast<size_t>(rng() % 257);
                const int root = static_cast<int>(rng() % static_cast<uint32_t>(n_ranks));
                const int shift = 1 + static_cast<int>(rng() % static_cast<uint32_t>(n_ranks - 1));
                if (kind == 0 || kind == 1) {
                    if (auto ok = check_all_gather(comm, bytes, op, kind == 1); !ok) return ok;
                } else if (kind == 2) {
                    buf.assign(bytes, std::byte{0});
                    if (me == root) fill(buf, root, op);
                    if (auto ok = comm.broadcast(buf, root); !ok) return ok;
                    if (auto ok = expect_pattern(buf, root, op, "broadcast"); !ok) return ok;
                } else if (kind == 3) {
                    if (auto ok = comm.barrier(); !ok) return ok;
                } else {
                    const int to = (me + shift) % n_ranks;
                    const int from = (me + n_ranks - shift) % n_ranks;
                    send.resize(bytes);
                    buf.assign(bytes, std::byte{0});
                    fill(send, me, op);
                    if (auto ok = comm.group_start(); !ok) return ok;
                    if (auto ok = comm.recv(buf, from); !ok) return ok;
                    if (auto ok = comm.send(send, to); !ok) return ok;
                    if (auto ok = comm.group_end(); !ok) return ok;
                    if (auto ok = expect_pattern(buf, from, op, "shift recv"); !ok) return ok;
                }
            }
            return {};
        });
        EXPECT_TRUE(run.has_value()) << "n=" << n << ": " << run.error().message;
    }
}

TEST(Comm, SixtyFourRanks) {
    auto run = run_ranks(64, [](int me, Communicator &comm) -> Result<void> {
        if (auto ok = check_all_gather(comm, 16, 0, true); !ok) return ok;
        Bytes buf(32);
        if (me == 63) fill(buf, 63, 1);
        if (auto ok = comm.broadcast(buf, 63); !ok) return ok;
        if (auto ok = expect_pattern(buf, 63, 1, "broadcast"); !ok) return ok;
        Bytes out(8), in(8);
        fill(out, me, 2);
        if (auto ok = comm.group_start(); !ok) return ok;
        if (auto ok = comm.send(out, (me + 1) % 64); !ok) return ok;
        if (auto ok = comm.recv(in, (me + 63) % 64); !ok) return ok;
        if (auto ok = comm.group_end(); !ok) return ok;
        if (auto ok = expect_pattern(in, (me + 63) % 64, 2, "ring"); !ok) return ok;
        return comm.barrier();
    });
    EXPECT_TRUE(run.has_value()) << run.error().message;
}

// ---- Mismatches: an error on every rank, with one message ----

TEST(Comm, MismatchedAllGatherSizesFailOnEveryRank) {
    auto messages = messages_of(3, [](int me, Communicator &comm) -> Result<void> {
        const size_t bytes = me == 1 ? 64 : 128;
        Bytes send(bytes), recv(3 * bytes);
        auto result = comm.all_gather(send, recv);
        // The group stays usable: the next collective is matched as the next one.
        if (auto ok = check_all_gather(comm, 32, 1, false); !ok) return make_error("after: {}", ok.error().message);
        return result;
    });
    for (const std::string &m : messages) {
        EXPECT_EQ(m, "all_gather (collective 0): rank 1 sent 64 bytes, rank 0 sent 128");
    }
}

TEST(Comm, MismatchedBroadcastRootsAndSizesFailOnEveryRank) {
    std::vector<std::string> sizes(4);
    auto roots = messages_of(4, [&](int me, Communicator &comm) -> Result<void> {
        Bytes buf(20);
        auto by_root = comm.broadcast(buf, me == 2 ? 1 : 0);
        Bytes other(me == 3 ? 10 : 20);
        auto by_size = comm.broadcast(other, 1);
        if (!by_size) sizes[static_cast<size_t>(me)] = by_size.error().message;
        return by_root;
    });
    for (const std::string &m : roots) {
        EXPECT_EQ(m, "broadcast (collective 0): rank 2 named root 1, rank 0 named root 0");
    }
    for (const std::string &m : sizes) {
        EXPECT_EQ(m, "broadcast (collective 1): rank 3 passed 10 bytes, rank 0 passed 20");
    }
}

TEST(Comm, MismatchedCollectiveKindsFailOnEveryRank) {
    auto messages = messages_of(3, [](int me, Communicator &comm) -> Result<void> {
        Bytes send(4), recv(12);
        return me == 1 ? comm.barrier() : comm.all_gather(send, recv);
    });
    for (const std::string &m : messages) EXPECT_EQ(m, "collective 0: rank 1 called barrier, rank 0 called all_gather");
}

TEST(Comm, SendRecvSizeMismatchFailsOnBothSides) {
    auto messages = messages_of(2, [](int me, Communicator &comm) -> Result<void> {
        Bytes small(64), big(128);
        auto result = me == 0 ? comm.send(small, 1) : comm.recv(big, 0);
        // The pair stays usable afterwards.
        Bytes out(16), in(16);
        fill(out, me, 9);
        if (auto ok = comm.group_start(); !ok) return ok;
        if (auto ok = comm.send(out, 1 - me); !ok) return ok;
        if (auto ok = comm.recv(in, 1 - me); !ok) return ok;
        if (auto ok = comm.group_end(); !ok) return make_error("after: {}", ok.error().message);
        if (auto ok = expect_pattern(in, 1 - me, 9, "after"); !ok) return ok;
        return result;
    });
    for (const std::string &m : messages) {
        EXPECT_EQ(m, "send/recv: rank 0 sent 64 bytes to rank 1, whose matching recv takes 128 bytes");
    }
}

// ---- Bad arguments: an error on the calling rank, which then takes part as if it had not called ----

TEST(Comm, BadArgumentsFailOnTheCallingRankOnly) {
    std::vector<std::string> bad;
    auto run = run_ranks(2, [&](int me, Communicator &comm) -> Result<void> {
        Bytes buf(8), recv(16), wrong(10);
        if (me == 0) {
            auto note = [&](Result<void> r) { bad.push_back(r ? std::string("ok") : r.error().message); };
            note(comm.send(buf, 0));
            note(comm.send(buf, 2));
            note(comm.recv(buf, -1));
            note(comm.recv(buf, 0));
            note(comm.broadcast(buf, 2));
            note(comm.broadcast(buf, -1));
            note(comm.all_gather(buf, wrong));
            note(comm.all_gather(std::span<const std::byte>(recv).subspan(4, 8), recv));
            note(comm.group_end());
            note(comm.group_start());
            note(comm.all_gather(buf, recv));
            note(comm.barrier());
            note(comm.broadcast(buf, 0));
            note(comm.group_end());  // an empty group: nothing to do
        }
        // Both ranks' first real collective meet, whatever rank 0 was refused before.
        return check_all_gather(comm, 8, 0, true);
    });
    ASSERT_TRUE(run.has_value()) << run.error().message;
    const std::vector<std::string> expected = {
        "send: peer 0 is this rank; a rank does not send to itself",
        "send: peer 2 is out of range for a group of 2 ranks",
        "recv: peer -1 is out of range for a group of 2 ranks",
        "recv: peer 0 is this rank; a rank does not recv to itself",
        "broadcast: root 2 is out of range for a group of 2 ranks",
        "broadcast: root -1 is out of range for a group of 2 ranks",
        "all_gather: recv holds 10 bytes, expected 2 ranks x 8 bytes = 16",
        "all_gather: send overlaps recv but is not this rank's slot (in place, rank 0 passes recv bytes [0, 8) as "
        "send)",
        "group_end: rank 0 has no open group_start",
        "ok",
        "all_gather: called inside a send/recv group (before group_end)",
        "barrier: called inside a send/recv group (before group_end)",
        "broadcast: called inside a send/recv group (before group_end)",
        "ok",
    };
    EXPECT_EQ(bad, expected);
}

TEST(Comm, CreateRefusesBadRankCounts) {
    for (int n : {0, -3, InProcessGroup::kMaxRanks + 1}) {
        auto group = InProcessGroup::create(n);
        ASSERT_FALSE(group.has_value());
        EXPECT_EQ(group.error().message, fmt::format("in-process group: expected 1 to 4096 ranks, found {}", n));
    }
    auto run = run_ranks(0, [](int, Communicator &) -> Result<void> { return {}; });
    ASSERT_FALSE(run.has_value());
    EXPECT_EQ(run.error().message, "in-process group: expected 1 to 4096 ranks, found 0");
}

// ---- Abort, failing ranks, deadlocks: errors instead of hangs ----

TEST(Comm, AbortReleasesBlockedRanksAndFailsLaterCalls) {
    auto group = InProcessGroup::create(4);
    ASSERT_TRUE(group.has_value());
    std::vector<std::string> messages(3);
    std::vector<std::thread> threads;
    // Rank 3 never calls, so nothing completes and no deadlock is declared: only abort() can end the waits.
    threads.emplace_back([&] { messages[0] = group->communicator(0).barrier().error().message; });
    threads.emplace_back([&] {
        Bytes send(8), recv(32);
        messages[1] = group->communicator(1).all_gather(send, recv).error().message;
    });
    threads.emplace_back([&] {
        Bytes in(8);
        messages[2] = group->communicator(2).recv(in, 3).error().message;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_FALSE(group->aborted());
    group->abort("operator stop");
    for (std::thread &t : threads) t.join();
    EXPECT_TRUE(group->aborted());
    EXPECT_EQ(messages[0], "barrier: group aborted: operator stop");
    EXPECT_EQ(messages[1], "all_gather: group aborted: operator stop");
    EXPECT_EQ(messages[2], "recv: group aborted: operator stop");
    // Later calls fail at once, and a second abort keeps the first reason.
    group->abort("second reason");
    Bytes buf(8);
    auto late = group->communicator(3).broadcast(buf, 0);
    ASSERT_FALSE(late.has_value());
    EXPECT_EQ(late.error().message, "broadcast: group aborted: operator stop");
    auto late_send = group->communicator(3).send(buf, 0);
    ASSERT_FALSE(late_send.has_value());
    EXPECT_EQ(late_send.error().message, "send: group aborted: operator stop");
}

TEST(Comm, RunReturnsTheFailingRanksErrorAndReleasesTheOthers) {
    // Rank 2 fails after the first collective; the others wait in the second one and must be released.
    std::atomic<int> released{0};
    auto run = run_ranks(4, [&](int me, Communicator &comm) -> Result<void> {
        if (auto ok = comm.barrier(); !ok) return ok;
        if (me == 2) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
            return make_error("disk on fire");
        }
        Bytes send(8), recv(32);
        auto r = comm.all_gather(send, recv);
        if (!r && r.error().message == "all_gather: group aborted: rank 2: disk on fire") released.fetch_add(1);
        return r;
    });
    ASSERT_FALSE(run.has_value());
    EXPECT_EQ(run.error().message, "rank 2: disk on fire");
    EXPECT_EQ(released.load(), 3);
}

TEST(Comm, RunTurnsExceptionsIntoErrors) {
    auto run = run_ranks(3, [](int me, Communicator &comm) -> Result<void> {
        if (me == 1) throw std::runtime_error("boom");
        return comm.barrier();
    });
    ASSERT_FALSE(run.has_value());
    EXPECT_EQ(run.error().message, "rank 1: threw an exception: boom");

    auto odd = run_ranks(2, [](int me, Communicator &comm) -> Result<void> {
        if (me == 0) throw 42;
        return comm.barrier();
    });
    ASSERT_FALSE(odd.has_value());
    EXPECT_EQ(odd.error().message, "rank 0: threw an exception that is not a std::exception");
}

TEST(Comm, RunReportsTheLowestRankWhenAllFailAlike) {
    // Every rank sees the same mismatch; the answer does not depend on which thread finished first.
    for (int attempt = 0; attempt < 5; ++attempt) {
        auto run = run_ranks(4, [](int me, Communicator &comm) -> Result<void> {
            Bytes buf(me == 3 ? 1 : 2);
            return comm.broadcast(buf, 0);
        });
        ASSERT_FALSE(run.has_value());
        EXPECT_EQ(run.error().message, "rank 0: broadcast (collective 0): rank 3 passed 1 bytes, rank 0 passed 2");
    }
}

TEST(Comm, ExternalAbortDuringRun) {
    auto group = InProcessGroup::create(3);
    ASSERT_TRUE(group.has_value());
    InProcessGroup &g = *group;
    auto run = g.run([&](int me, Communicator &comm) -> Result<void> {
        if (me == 0) {
            // Running, not blocked: the group is not deadlocked, so only the abort releases ranks 1 and 2.
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            g.abort("shutdown requested");
            return {};
        }
        return comm.barrier();
    });
    ASSERT_FALSE(run.has_value());
    EXPECT_EQ(run.error().message, "rank 1: barrier: group aborted: shutdown requested");
    auto again = g.run([](int, Communicator &comm) -> Result<void> { return comm.barrier(); });
    ASSERT_FALSE(again.has_value());
    EXPECT_EQ(again.error().message, "rank 0: barrier: group aborted: shutdown requested");
}

TEST(Comm, DeadlocksAreReportedInsteadOfHanging) {
    // Both ranks send first without a group: each send waits for a recv that never comes.
    auto sends = run_ranks(2, [](int me, Communicator &comm) -> Result<void> {
        Bytes out(8), in(8);
        if (auto ok = comm.send(out, 1 - me); !ok) return ok;
        return comm.recv(in, 1 - me);
    });
    ASSERT_FALSE(sends.has_value());
    EXPECT_EQ(sends.error().message,
              "rank 0: send: group aborted: deadlock: rank 0 waits for rank 1 to recv its send of 8 bytes; rank 1 "
              "waits for rank 0 to recv its send of 8 bytes");

    // A rank returns while the others wait for it in a collective.
    auto early = run_ranks(3, [](int me, Communicator &comm) -> Result<void> {
        if (me == 1) return {};
        return comm.barrier();
    });
    ASSERT_FALSE(early.has_value());
    EXPECT_EQ(early.error().message,
              "rank 0: barrier: group aborted: deadlock: rank 0 waits in barrier (collective 0); rank 1 has "
              "returned from its rank function; rank 2 waits in barrier (collective 0)");

    // A recv from a rank that waits in a collective.
    auto crossed = run_ranks(2, [](int me, Communicator &comm) -> Result<void> {
        std::array<std::byte, 4> in{};
        return me == 0 ? comm.recv(in, 1) : comm.barrier();
    });
    ASSERT_FALSE(crossed.has_value());
    EXPECT_EQ(crossed.error().message,
              "rank 0: recv: group aborted: deadlock: rank 0 waits to recv 4 bytes from rank 1; rank 1 waits in "
              "barrier (collective 0)");
}

TEST(Comm, GroupRunsAgainAfterSuccessAndWorksWithOwnThreads) {
    auto group = InProcessGroup::create(3);
    ASSERT_TRUE(group.has_value());
    for (int pass = 0; pass < 2; ++pass) {
        auto run = group->run([&](int, Communicator &comm) -> Result<void> {
            return check_all_gather(comm, 24, pass, pass == 1);
        });
        EXPECT_TRUE(run.has_value()) << run.error().message;
    }
    std::vector<std::string> messages(3);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
        threads.emplace_back([&, r] {
            auto ok = check_all_gather(group->communicator(r), 5, 7, false);
            if (!ok) messages[static_cast<size_t>(r)] = ok.error().message;
        });
    }
    for (std::thread &t : threads) t.join();
    for (const std::string &m : messages) EXPECT_EQ(m, "");
    EXPECT_EQ(group->size(), 3);
    EXPECT_EQ(group->communicator(2).rank(), 2);
    EXPECT_EQ(group->communicator(2).size(), 3);
}

TEST(Comm, MoveAssignedGroupStopsTheOldThreadsAndRunsTheNewOnes) {
    auto a = InProcessGroup::create(3);
    auto b = InProcessGroup::create(2);
    ASSERT_TRUE(a.has_value() && b.has_value());
    ASSERT_TRUE(a->run([](int, Communicator &comm) { return comm.barrier(); }).has_value());
    *a = std::move(*b);  // a's three rank threads are stopped and joined here
    EXPECT_EQ(a->size(), 2);
    int ran = 0;
    auto run = a->run([&](int me, Communicator &comm) -> Result<void> {
        if (me == 0) ran = 1;
        return comm.barrier();
    });
    EXPECT_TRUE(run.has_value()) << run.error().message;
    EXPECT_EQ(ran, 1);
}

// ---- The hot path ----

TEST(CommHotPath, SteadyStateOperationsDoNotAllocate) {
    constexpr int kRanks = 4;
    constexpr size_t kBytes = 4096;
    int64_t before = 0, after = 0, refused_allocations = 0;
    int bad_steps = 0;
    std::atomic<int> bad{0};
    auto run = run_ranks(kRanks, [&](int me, Communicator &comm) -> Result<void> {
        Bytes send(kBytes), recv(kRanks * kBytes), buf(kBytes), in(kBytes);
        fill(send, me, 0);
        const int next = (me + 1) % kRanks;
        const int prev = (me + kRanks - 1) % kRanks;
        // One step exercises every operation; it checks bytes without allocating.
        auto step = [&](int i) -> bool {
            bool ok = comm.all_gather(send, recv).has_value();
            for (int r = 0; r < kRanks && ok; ++r) {
                ok = recv[static_cast<size_t>(r) * kBytes + 5] == pattern(r, 0, 5);
            }
            if (me == i % kRanks) fill(buf, me, 1);
            ok = comm.broadcast(buf, i % kRanks).has_value() && ok && buf[9] == pattern(i % kRanks, 1, 9);
            ok = comm.group_start().has_value() && ok;
            ok = comm.send(send, next).has_value() && ok;
            ok = comm.recv(in, prev).has_value() && ok;
            ok = comm.group_end().has_value() && ok && in[11] == pattern(prev, 0, 11);
            return comm.barrier().has_value() && ok;
        };
        bool ok = step(0);  // warm-up
        if (auto b = comm.barrier(); !b) return b;
        if (me == 0) before = g_allocations.load();
        if (auto b = comm.barrier(); !b) return b;
        for (int i = 0; i < 200; ++i) ok = step(i) && ok;
        if (auto b = comm.barrier(); !b) return b;
        if (me == 0) after = g_allocations.load();
        if (!ok) bad.fetch_add(1);
        if (auto b = comm.barrier(); !b) return b;
        if (me == 0) {
            // The counter sees allocations made inside memra: a refused call builds a heap message.
            const int64_t start = g_allocations.load();
            auto refused = comm.send(send, 0);
            refused_allocations = g_allocations.load() - start;
            if (refused) return make_error("send to self was accepted");
        }
        return {};
    });
    bad_steps = bad.load();
    ASSERT_TRUE(run.has_value()) << run.error().message;
    EXPECT_EQ(bad_steps, 0);
    EXPECT_EQ(after - before, 0);
    EXPECT_GT(refused_allocations, 0);
}

TEST(CommHotPath, RunKeepsEachRanksThreadAndAllocatesNothing) {
    constexpr int kRanks = 4;
    auto group = InProcessGroup::create(kRanks);
    ASSERT_TRUE(group.has_value());
    std::array<std::thread::id, kRanks> first{}, now{};
    std::array<int64_t, kRanks> sums{};
    int64_t a = 1, b = 2, c = 3, d = 4;  // captured by reference, with the arrays: a large closure
    auto body = [&](int me, Communicator &comm) -> Result<void> {
        now[static_cast<size_t>(me)] = std::this_thread::get_id();
        sums[static_cast<size_t>(me)] += a + b + c + d + me;
        return comm.barrier();
    };
    ASSERT_TRUE(group->run(body).has_value());
    first = now;
    const int64_t before = g_allocations.load();
    int moved = 0;
    for (int i = 0; i < 50; ++i) {
        auto run = group->run(body);
        ASSERT_TRUE(run.has_value()) << run.error().message;
        if (now != first) ++moved;
    }
    EXPECT_EQ(g_allocations.load() - before, 0);
    EXPECT_EQ(moved, 0);  // rank r ran on the same thread every time
    for (int r = 0; r < kRanks; ++r) {
        EXPECT_EQ(sums[static_cast<size_t>(r)], 51 * (10 + r));
        EXPECT_NE(first[static_cast<size_t>(r)], std::this_thread::get_id());
        for (int q = 0; q < r; ++q) EXPECT_NE(first[static_cast<size_t>(r)], first[static_cast<size_t>(q)]);
    }
}

TEST(CommHotPath, MeasuredAllGatherOf4KiB) {
    constexpr size_t kBytes = 4096;
    for (int n : {2, 4, 8}) {
        const int iters = 4000 / n;
        int64_t ns = 0;
        auto run = run_ranks(n, [&](int me, Communicator &comm) -> Result<void> {
            Bytes send(kBytes), recv(static_cast<size_t>(n) * kBytes);
            fill(send, me, 3);
            for (int i = 0; i < 20; ++i) {
                if (auto ok = comm.all_gather(send, recv); !ok) return ok;
            }
            if (auto ok = comm.barrier(); !ok) return ok;
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < iters; ++i) {
                if (auto ok = comm.all_gather(send, recv); !ok) return ok;
            }
            if (auto ok = comm.barrier(); !ok) return ok;
            const auto elapsed = std::chrono::steady_clock::now() - t0;
            if (me == 0) ns = std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count();
            for (int r = 0; r < n; ++r) {
                auto slot = std::span<const std::byte>(recv).subspan(static_cast<size_t>(r) * kBytes, kBytes);
                if (auto ok = expect_pattern(slot, r, 3, "timed all_gather"); !ok) return ok;
            }
            return {};
        });
        ASSERT_TRUE(run.has_value()) << run.error().message;
        const int64_t per_op = ns / iters;
        std::printf("[ measured ] all_gather 4 KiB, %d ranks: %lld ns per op (%d ops, %u hardware threads)\n", n,
                    static_cast<long long>(per_op), iters, std::thread::hardware_concurrency());
        RecordProperty(fmt::format("all_gather_4KiB_ns_n{}", n), static_cast<int>(per_op));
        EXPECT_GT(per_op, 0);
    }
}

}  // namespace
}  // namespace memra::parallel
