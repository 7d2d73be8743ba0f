// Tests for MpiCommunicator and the MPI world helpers, run as 4 processes under mpirun (the CTest test
// parallel.mpi_4_processes). Every process runs every test in the same order, and every test makes the same
// communicator calls on every rank whatever its checks find, so a failing check never leaves a peer waiting.
// Covered: the world, byte-exact all-gather (apart and in place), broadcast from each root, barrier ordering,
// ring shifts and pairwise exchanges of rank-dependent sizes in groups (nested, larger than the reserved
// room), zero-byte messages, refused arguments taking no part, recvs of another size, mpi_broadcast, and no
// heap allocation on the steady-state path.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "parallel/mpi_comm.h"

#include "alloc_counter.h"

namespace memra::parallel {
namespace {

constexpr int kRanks = 4;  // the CTest entry starts 4 processes

MpiWorld g_world;
MpiCommunicator *g_comm = nullptr;  // made by main() for the whole run

Communicator &comm() { return *g_comm; }
int me() { return g_comm->rank(); }
int next_rank() { return (me() + 1) % kRanks; }
int prev_rank() { return (me() + kRanks - 1) % kRanks; }

using Bytes = std::vector<std::byte>;

// Byte i of message `tag` from rank `from` to rank `to` (-1: to every rank): a wrong sender, receiver, message
// or offset gives other bytes.
std::byte mark(int from, int to, int tag, size_t i) {
    uint64_t x = static_cast<uint64_t>(i) + 0x632BE59BD9B4E019ull;
    x ^= static_cast<uint64_t>(from + 3) << 40;
    x ^= static_cast<uint64_t>(to + 5) << 48;
    x ^= static_cast<uint64_t>(tag + 7) << 56;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 29;
    return static_cast<std::byte>(x >> 24);
}

void fill(std::span<std::byte> s, int from, int to, int tag) {
    for (size_t i = 0; i < s.size(); ++i) s[i] = mark(from, to, tag, i);
}

Bytes message(size_t n, int from, int to, int tag) {
    Bytes b(n);
    fill(b, from, to, tag);
    return b;
}

testing::AssertionResult holds(std::span<const std::byte> got, int from, int to, int tag) {
    for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != mark(from, to, tag, i)) {
            return testing::AssertionFailure() << "byte " << i << " of " << got.size() << " is "
                                               << static_cast<int>(got[i]) << ", expected "
                                               << static_cast<int>(mark(from, to, tag, i)) << " (message " << tag
                                               << " from rank " << from << " to rank " << to << ")";
        }
    }
    return testing::AssertionSuccess();
}

// "" for success, else the message: EXPECT_EQ(error_of(r), "") prints what failed.
std::string error_of(const Result<void> &r) { return r ? std::string() : r.error().message; }

// Every rank's `value`, in rank order (an all-gather).
template <class T>
std::array<T, kRanks> gather(const T &value) {
    std::array<T, kRanks> all{};
    EXPECT_EQ(error_of(comm().all_gather(std::as_bytes(std::span(&value, 1)), std::as_writable_bytes(std::span(all)))),
              "");
    return all;
}

// A valid all-gather after refused or failed calls: right bytes on every rank show that the ranks are in step.
void expect_in_step(int tag) {
    Bytes recv(kRanks * 33, std::byte{0xEE});
    const Bytes send = message(33, me(), -1, tag);
    ASSERT_EQ(error_of(comm().all_gather(send, recv)), "");
    for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(holds(std::span(recv).subspan(r * 33u, 33), r, -1, tag));
}

// Address space without memory (PROT_NONE): spans longer than MPI's counts allow, never touched.
class Reserved {
public:
    explicit Reserved(size_t bytes) : bytes_(bytes) {
        void *p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        data_ = p == MAP_FAILED ? nullptr : static_cast<std::byte *>(p);
    }
    ~Reserved() {
        if (data_ != nullptr) munmap(data_, bytes_);
    }
    Reserved(const Reserved &) = delete;
    Reserved &operator=(const Reserved &) = delete;
    std::span<std::byte> span() const { return {data_, data_ == nullptr ? 0 : bytes_}; }

private:
    std::byte *data_ = nullptr;
    size_t bytes_;
};

TEST(MpiWorld, FourProcessesOfThisHost) {
    EXPECT_TRUE(launched_by_mpi());
    auto again = mpi_init();
    ASSERT_TRUE(again.has_value()) << again.error().message;
    EXPECT_EQ(again->rank, g_world.rank);
    EXPECT_EQ(again->size, g_world.size);
    EXPECT_EQ(again->local_rank, g_world.local_rank);
    EXPECT_EQ(again->local_size, g_world.local_size);
    EXPECT_EQ(g_world.size, kRanks);
    EXPECT_EQ(comm().size(), kRanks);
    EXPECT_EQ(comm().rank(), g_world.rank);

    const std::array<int32_t, 3> facts = {g_world.rank, g_world.local_rank, g_world.local_size};
    const auto all = gather(facts);
    std::array<int, kRanks> local_seen{};
    for (int r = 0; r < kRanks; ++r) {
        EXPECT_EQ(all[r][0], r) << "slot " << r << " of the all-gather";
        EXPECT_EQ(all[r][2], kRanks) << "rank " << r << ": every process runs on this host";
        if (all[r][1] >= 0 && all[r][1] < kRanks) ++local_seen[static_cast<size_t>(all[r][1])];
    }
    for (int l = 0; l < kRanks; ++l) EXPECT_EQ(local_seen[static_cast<size_t>(l)], 1) << "local rank " << l;
}

TEST(MpiCommunicator, AllGatherApartAndInPlace) {
    int tag = 0;
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{3}, size_t{64}, size_t{4097}, size_t{1} << 20}) {
        for (bool in_place : {false, true}) {
            ++tag;
            Bytes recv(kRanks * bytes, std::byte{0xEE});
            Bytes send(bytes);
            const std::span<std::byte> own = std::span(recv).subspan(me() * bytes, bytes);
            const std::span<std::byte> src = in_place ? own : std::span<std::byte>(send);
            fill(src, me(), -1, tag);
            EXPECT_EQ(error_of(comm().all_gather(src, recv)), "") << bytes << " bytes, in place " << in_place;
            for (int r = 0; r < kRanks; ++r) {
                EXPECT_TRUE(holds(std::span(recv).subspan(r * bytes, bytes), r, -1, tag))
                    << "slot " << r << ", " << bytes << " bytes, in place " << in_place;
            }
        }
    }
}

TEST(MpiCommunicator, BroadcastFromEveryRoot) {
    int tag = 0;
    for (int root : {1, 2, 3, 0}) {
        for (size_t bytes : {size_t{0}, size_t{5}, size_t{100000}}) {
            ++tag;
            Bytes buf = message(bytes, me(), me(), 99);  // what the root's bytes must replace
            if (me() == root) fill(buf, root, -1, tag);
            EXPECT_EQ(error_of(comm().broadcast(buf, root)), "") << "root " << root;
            EXPECT_TRUE(holds(buf, root, -1, tag)) << "root " << root << ", " << bytes << " bytes";
        }
    }
}

// Clocks of one host agree (steady_clock is CLOCK_MONOTONIC): no rank leaves the barrier before the late
// rank has entered it.
TEST(MpiCommunicator, BarrierHoldsEveryRankUntilTheLastArrives) {
    using Clock = std::chrono::steady_clock;
    for (int late : {3, 0}) {
        if (me() == late) std::this_thread::sleep_for(std::chrono::milliseconds(150));
        const int64_t entered = Clock::now().time_since_epoch().count();
        EXPECT_EQ(error_of(comm().barrier()), "");
        const int64_t left = Clock::now().time_since_epoch().count();
        const auto all = gather(std::array<int64_t, 2>{entered, left});
        for (int r = 0; r < kRanks; ++r) {
            EXPECT_GE(all[r][1], all[late][0]) << "rank " << r << " left before the late rank " << late << " entered";
        }
    }
}

TEST(MpiCommunicator, RingShiftInOneGroup) {
    int tag = 0;
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{1000}, size_t{300000}}) {
        for (bool recv_first : {false, true}) {
            ++tag;
            const Bytes send = message(bytes, me(), next_rank(), tag);
            Bytes recv(bytes, std::byte{0xEE});
            EXPECT_EQ(error_of(comm().group_start()), "");
            if (recv_first) {
                EXPECT_EQ(error_of(comm().recv(recv, prev_rank())), "");
            }
            EXPECT_EQ(error_of(comm().send(send, next_rank())), "");
            if (!recv_first) {
                EXPECT_EQ(error_of(comm().recv(recv, prev_rank())), "");
            }
            EXPECT_EQ(error_of(comm().group_end()), "");
            EXPECT_TRUE(holds(recv, prev_rank(), me(), tag)) << bytes << " bytes";
        }
    }
}

TEST(MpiCommunicator, NestedGroupsRunAtTheOutermostEnd) {
    const Bytes send = message(4096, me(), next_rank(), 1);
    Bytes recv(4096, std::byte{0xEE});
    EXPECT_EQ(error_of(comm().group_start()), "");
    EXPECT_EQ(error_of(comm().send(send, next_rank())), "");
    EXPECT_EQ(error_of(comm().group_start()), "");
    EXPECT_EQ(error_of(comm().recv(recv, prev_rank())), "");
    EXPECT_EQ(error_of(comm().group_start()), "");
    EXPECT_EQ(error_of(comm().group_end()), "");
    EXPECT_EQ(error_of(comm().group_end()), "");
    EXPECT_EQ(recv, Bytes(4096, std::byte{0xEE})) << "an inner group_end ran the recorded recv";
    EXPECT_EQ(error_of(comm().group_end()), "");
    EXPECT_TRUE(holds(recv, prev_rank(), me(), 1));

    const auto unopened = comm().group_end();
    ASSERT_FALSE(unopened.has_value());
    EXPECT_NE(unopened.error().message.find("no open group_start"), std::string::npos) << unopened.error().message;
    expect_in_step(2);
}

// Each rank sends (r + 1) * 7 bytes to every other rank and receives (p + 1) * 7 from each p, twice per pair in
// one group (the second message one byte longer, so FIFO order per pair shows), peers visited in an order that
// differs per rank. 12 operations exceed the 8 reserved for a group: the second round reuses the grown room.
TEST(MpiCommunicator, PairwiseExchangeOfRankDependentSizes) {
    auto bytes_from = [](int rank, int round) { return static_cast<size_t>(rank + 1) * 7 + static_cast<size_t>(round); };
    for (int pass = 0; pass < 2; ++pass) {
        std::vector<Bytes> sends, recvs;
        std::vector<int> peers;
        for (int k = 1; k < kRanks; ++k) peers.push_back((me() + k) % kRanks);
        EXPECT_EQ(error_of(comm().group_start()), "");
        for (int round = 0; round < 2; ++round) {
            for (int p : peers) {
                sends.push_back(message(bytes_from(me(), round), me(), p, 10 * pass + round));
                recvs.push_back(Bytes(bytes_from(p, round), std::byte{0xEE}));
            }
        }
        // Recorded in an order of its own: all of round 0 before round 1 for each peer, recvs and sends mixed.
        size_t i = 0;
        for (int round = 0; round < 2; ++round) {
            for (int p : peers) {
                if ((me() + p + round) % 2 == 0) {
                    EXPECT_EQ(error_of(comm().send(sends[i], p)), "");
                    EXPECT_EQ(error_of(comm().recv(recvs[i], p)), "");
                } else {
                    EXPECT_EQ(error_of(comm().recv(recvs[i], p)), "");
                    EXPECT_EQ(error_of(comm().send(sends[i], p)), "");
                }
                ++i;
            }
        }
        EXPECT_EQ(error_of(comm().group_end()), "");
        i = 0;
        for (int round = 0; round < 2; ++round) {
            for (int p : peers) {
                EXPECT_EQ(recvs[i].size(), bytes_from(p, round));
                EXPECT_TRUE(holds(recvs[i], p, me(), 10 * pass + round)) << "round " << round << " from rank " << p;
                ++i;
            }
        }
    }
}

TEST(MpiCommunicator, ZeroByteMessagesMatchLikeAnyOther) {
    // Outside a group, pairs (0, 1) and (2, 3): the even rank sends first.
    const int partner = me() ^ 1;
    const std::span<const std::byte> none;
    const std::span<std::byte> nowhere;
    if (me() % 2 == 0) {
        EXPECT_EQ(error_of(comm().send(none, partner)), "");
        EXPECT_EQ(error_of(comm().recv(nowhere, partner)), "");
    } else {
        EXPECT_EQ(error_of(comm().recv(nowhere, partner)), "");
        EXPECT_EQ(error_of(comm().send(none, partner)), "");
    }
    // In a ring, an empty message then a full one: the empty recv must take the empty send.
    const Bytes send = message(16, me(), next_rank(), 3);
    Bytes recv(16, std::byte{0xEE});
    EXPECT_EQ(error_of(comm().group_start()), "");
    EXPECT_EQ(error_of(comm().send(none, next_rank())), "");
    EXPECT_EQ(error_of(comm().send(send, next_rank())), "");
    EXPECT_EQ(error_of(comm().recv(nowhere, prev_rank())), "");
    EXPECT_EQ(error_of(comm().recv(recv, prev_rank())), "");
    EXPECT_EQ(error_of(comm().group_end()), "");
    EXPECT_TRUE(holds(recv, prev_rank(), me(), 3));
}

void expect_refused(const Result<void> &r, const std::string &says, const char *what) {
    ASSERT_FALSE(r.has_value()) << what << " was not refused";
    EXPECT_NE(r.error().message.find(says), std::string::npos) << what << ": " << r.error().message;
}

TEST(MpiCommunicator, RefusedCallsTakeNoPart) {
    Bytes buf(8);
    const std::span<const std::byte> cbuf(buf);
    for (int peer : {-1, kRanks}) {
        expect_refused(comm().send(cbuf, peer), "is out of range for a communicator of 4 ranks", "send, bad peer");
        expect_refused(comm().recv(buf, peer), "is out of range for a communicator of 4 ranks", "recv, bad peer");
    }
    expect_refused(comm().send(cbuf, me()), "is this rank", "send to itself");
    expect_refused(comm().recv(buf, me()), "is this rank", "recv from itself");

    Bytes recv(kRanks * 8);
    expect_refused(comm().all_gather(cbuf, std::span(recv).first(kRanks * 8 - 1)),
                   "recv holds 31 bytes, expected 4 ranks x 8 bytes = 32", "all_gather, short recv");
    const int other = next_rank();
    expect_refused(comm().all_gather(std::span(recv).subspan(other * 8u, 8), recv), "send overlaps recv",
                   "all_gather from another rank's slot");
    expect_refused(comm().all_gather(std::span(recv).subspan(me() * 8u + 1, 8), recv), "send overlaps recv",
                   "all_gather from a misaligned slot");
    expect_refused(comm().broadcast(buf, kRanks), "root 4 is out of range", "broadcast, bad root");
    expect_refused(comm().broadcast(buf, -1), "root -1 is out of range", "broadcast, bad root");

    // Inside a group: collectives and bad peers are refused, and the group's valid operations still run.
    const Bytes send = message(24, me(), next_rank(), 5);
    Bytes got(24, std::byte{0xEE});
    EXPECT_EQ(error_of(comm().group_start()), "");
    expect_refused(comm().all_gather(cbuf, recv), "inside a send/recv group", "all_gather in a group");
    expect_refused(comm().broadcast(buf, 0), "inside a send/recv group", "broadcast in a group");
    expect_refused(comm().barrier(), "inside a send/recv group", "barrier in a group");
    EXPECT_EQ(error_of(comm().send(send, next_rank())), "");
    expect_refused(comm().send(cbuf, me()), "is this rank", "send to itself in a group");
    expect_refused(comm().recv(buf, kRanks), "out of range", "recv from a bad peer in a group");
    EXPECT_EQ(error_of(comm().recv(got, prev_rank())), "");
    EXPECT_EQ(error_of(comm().group_end()), "");
    EXPECT_TRUE(holds(got, prev_rank(), me(), 5));

    // More bytes than an MPI count holds: refused before MPI sees them (the spans are never touched).
    const size_t over = size_t{INT_MAX} + 1;
    Reserved big(kRanks * over);
    ASSERT_EQ(big.span().size(), kRanks * over) << "could not reserve address space";
    const std::span<std::byte> huge = big.span().first(over);
    expect_refused(comm().send(huge, next_rank()), "exceed MPI's count limit", "send of INT_MAX + 1 bytes");
    expect_refused(comm().recv(huge, prev_rank()), "exceed MPI's count limit", "recv of INT_MAX + 1 bytes");
    expect_refused(comm().broadcast(huge, 0), "exceed MPI's count limit", "broadcast of INT_MAX + 1 bytes");
    expect_refused(comm().all_gather(big.span().subspan(me() * over, over), big.span()), "exceed MPI's count limit",
                   "all_gather of INT_MAX + 1 bytes per rank");
    expect_refused(mpi_broadcast(huge, 0), "exceed MPI's count limit", "mpi_broadcast of INT_MAX + 1 bytes");
    expect_refused(mpi_broadcast(buf, kRanks), "root 4 is out of range", "mpi_broadcast, bad root");

    expect_in_step(6);
}

// A recv of another size than its send fails on the receiving rank, and the ranks stay in step.
TEST(MpiCommunicator, RecvOfAnotherSizeFails) {
    // Outside a group: rank 0 sends 10 bytes to rank 1, which takes 8; rank 2 sends 8 to rank 3, which takes 10.
    const size_t sent = me() < 2 ? 10 : 8;
    const size_t taken = me() < 2 ? 8 : 10;
    if (me() % 2 == 0) {
        const Bytes send = message(sent, me(), me() + 1, 1);
        (void)comm().send(send, me() + 1);  // MPI does not tell the sender
    } else {
        Bytes recv(taken);
        const auto r = comm().recv(recv, me() - 1);
        expect_refused(r,
                       fmt::format("rank {} sent {} bytes to rank {}, whose matching recv takes {} bytes", me() - 1,
                                   sent, me(), taken),
                       "recv of another size");
    }
    expect_in_step(2);

    // In a group: each rank sends 16 bytes on, and 4 bytes back; rank 1 takes 20 and rank 2 takes 12 of the 16.
    // Their 4-byte messages still arrive, and every other rank succeeds.
    const size_t forward_taken = me() == 1 ? 20 : me() == 2 ? 12 : 16;
    const Bytes forward = message(16, me(), next_rank(), 3);
    const Bytes back = message(4, me(), prev_rank(), 4);
    Bytes got_forward(forward_taken), got_back(4, std::byte{0xEE});
    EXPECT_EQ(error_of(comm().group_start()), "");
    EXPECT_EQ(error_of(comm().recv(got_forward, prev_rank())), "");
    EXPECT_EQ(error_of(comm().send(forward, next_rank())), "");
    EXPECT_EQ(error_of(comm().send(back, prev_rank())), "");
    EXPECT_EQ(error_of(comm().recv(got_back, next_rank())), "");
    const auto ended = comm().group_end();
    if (forward_taken == 16) {
        EXPECT_EQ(error_of(ended), "");
        EXPECT_TRUE(holds(got_forward, prev_rank(), me(), 3));
    } else {
        expect_refused(ended,
                       fmt::format("rank {} sent 16 bytes to rank {}, whose matching recv takes {} bytes", prev_rank(),
                                   me(), forward_taken),
                       "a group's recv of another size");
    }
    EXPECT_TRUE(holds(got_back, next_rank(), me(), 4));
    expect_in_step(5);
}

TEST(MpiBroadcast, HandsRankZerosIdToEveryProcess) {
    std::array<std::byte, 128> id{};
    if (me() == 0) fill(id, 0, -1, 42);
    EXPECT_EQ(error_of(mpi_broadcast(id, 0)), "");
    EXPECT_TRUE(holds(id, 0, -1, 42));
    // The communicator's traffic is apart from mpi_broadcast's.
    expect_in_step(7);
}

TEST(MpiCommunicator, AnotherCommunicatorWorksBesideTheFirst) {
    auto second = MpiCommunicator::create();
    ASSERT_TRUE(second.has_value()) << second.error().message;
    EXPECT_EQ((*second)->rank(), me());
    EXPECT_EQ((*second)->size(), kRanks);
    Bytes buf = message(77, me(), me(), 0);
    if (me() == 2) fill(buf, 2, -1, 8);
    EXPECT_EQ(error_of((*second)->broadcast(buf, 2)), "");
    EXPECT_TRUE(holds(buf, 2, -1, 8));
    second->reset();
    expect_in_step(9);
}

// One step of every operation, including a group larger than the reserved room, allocates nothing with
// operator new once a first step has grown that room.
TEST(MpiCommunicator, SteadyStateAllocatesNothing) {
    Bytes gather_recv(kRanks * 256), bcast(512), ring_send(1024), ring_recv(1024);
    std::vector<Bytes> sends(2 * (kRanks - 1), Bytes(64)), recvs(2 * (kRanks - 1), Bytes(64));
    const int partner = me() ^ 1;
    auto step = [&]() {
        bool ok = true;
        ok &= comm().all_gather(std::span(gather_recv).subspan(me() * 256u, 256), gather_recv).has_value();
        ok &= comm().broadcast(bcast, 1).has_value();
        ok &= comm().barrier().has_value();
        ok &= comm().group_start().has_value();
        ok &= comm().send(ring_send, next_rank()).has_value();
        ok &= comm().recv(ring_recv, prev_rank()).has_value();
        ok &= comm().group_end().has_value();
        ok &= comm().group_start().has_value();
        for (size_t i = 0; i < sends.size(); ++i) {
            const int p = (me() + 1 + static_cast<int>(i) % (kRanks - 1)) % kRanks;
            ok &= comm().send(sends[i], p).has_value();
            ok &= comm().recv(recvs[i], p).has_value();
        }
        ok &= comm().group_end().has_value();
        if (me() % 2 == 0) {
            ok &= comm().send(ring_send, partner).has_value();
            ok &= comm().recv(ring_recv, partner).has_value();
        } else {
            ok &= comm().recv(ring_recv, partner).has_value();
            ok &= comm().send(ring_send, partner).has_value();
        }
        return ok;
    };
    EXPECT_TRUE(step());
    const int64_t before = g_allocations.load();
    const bool ok = step();
    const int64_t allocated = g_allocations.load() - before;
    EXPECT_TRUE(ok);
    EXPECT_EQ(allocated, 0);
}

// On ranks above 0 gtest's report is replaced by this: only failures, each marked with the rank.
class FailurePrinter : public testing::EmptyTestEventListener {
public:
    explicit FailurePrinter(int rank) : rank_(rank) {}

    void OnTestPartResult(const testing::TestPartResult &result) override {
        if (!result.failed()) return;
        std::printf("[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                    result.line_number(), result.message());
        std::fflush(stdout);
    }
    void OnTestEnd(const testing::TestInfo &info) override {
        if (!info.result()->Failed()) return;
        std::printf("[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
        std::fflush(stdout);
    }

private:
    int rank_;
};

}  // namespace
}  // namespace memra::parallel

// Initialises MPI, runs the tests on one communicator shared by all of them, and finalizes. A failure on any
// rank makes that process exit non-zero, and mpirun with it.
int main(int argc, char **argv) {
    using namespace memra::parallel;
    testing::InitGoogleTest(&argc, argv);
    auto world = mpi_init();
    if (!world) {
        std::fprintf(stderr, "memra_mpi_tests: %s\n", world.error().message.c_str());
        return 1;
    }
    if (world->size != kRanks) {  // the tests are written for 4 ranks, and would hang with others
        if (world->rank == 0) {
            std::fprintf(stderr, "memra_mpi_tests: expected %d processes (mpirun -np %d), found %d\n", kRanks, kRanks,
                         world->size);
        }
        mpi_finalize();
        return 1;
    }
    auto comm = MpiCommunicator::create();
    if (!comm) {
        std::fprintf(stderr, "memra_mpi_tests (rank %d): %s\n", world->rank, comm.error().message.c_str());
        mpi_abort(1);
    }
    g_world = *world;
    g_comm = comm->get();
    if (world->rank > 0) {
        testing::TestEventListeners &listeners = testing::UnitTest::GetInstance()->listeners();
        delete listeners.Release(listeners.default_result_printer());
        listeners.Append(new FailurePrinter(world->rank));
    }
    const int status = RUN_ALL_TESTS();
    // Rank 0's report counts its own tests only: it names the other ranks that failed some.
    const int32_t failed = testing::UnitTest::GetInstance()->failed_test_count();
    std::array<int32_t, kRanks> failed_by_rank{};
    if ((*comm)->all_gather(std::as_bytes(std::span(&failed, 1)), std::as_writable_bytes(std::span(failed_by_rank))) &&
        world->rank == 0) {
        for (int r = 1; r < kRanks; ++r) {
            if (failed_by_rank[r] > 0) std::printf("[rank %d] %d failed tests (listed above)\n", r, failed_by_rank[r]);
        }
    }
    g_comm = nullptr;
    comm->reset();
    mpi_finalize();
    return status;
}
