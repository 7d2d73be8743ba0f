// Tests for the NCCL communicator (backend/cuda/nccl_comm.h). One GPU: a one-rank communicator copies bytes
// exactly (all-gather apart and in place, broadcast, a send/recv to itself inside a group), its barrier waits
// for the stream, zero-byte operations do nothing, every refused argument is named in its Error and takes no
// part in the call order, and a rank whose peer never joins fails after its timeout instead of hanging. Two
// or more GPUs: an NcclGroup of up to 8 ranks, one thread each, all-gathers rank-distinct bytes, shifts a ring
// with grouped sends and recvs (also driven from one thread) and broadcasts from every root, bit for bit.
// Every test skips without a GPU.
#ifdef MEMRA_HAVE_NCCL

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "backend/cuda/convert.h"
#include "backend/cuda/nccl_comm.h"
#include "cuda/cuda_test_util.h"

namespace memra::cuda {
namespace {

using Bytes = std::vector<std::byte>;
using std::chrono::milliseconds;

constexpr std::byte kUnwritten{0xEE};  // what recv buffers hold before an operation

// A byte that depends on the rank, the operation and the position, so a byte from the wrong rank, the
// wrong operation or the wrong offset is caught.
std::byte pattern(int rank, int op, size_t i) {
    uint64_t x = (static_cast<uint64_t>(rank) << 40) ^ (static_cast<uint64_t>(op) << 24) ^ i;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return static_cast<std::byte>((x ^ (x >> 31)) & 0xff);
}

Bytes patterned(size_t n, int rank, int op) {
    Bytes b(n);
    for (size_t i = 0; i < n; ++i) b[i] = pattern(rank, op, i);
    return b;
}

// The first byte of got[offset, offset + n) that is not pattern(rank, op, i), as an error.
Result<void> expect_pattern(const Bytes &got, size_t offset, size_t n, int rank, int op, const char *what) {
    for (size_t i = 0; i < n; ++i) {
        if (got[offset + i] != pattern(rank, op, i)) {
            return make_error("{} (op {}): byte {} is {}, expected {} (rank {}'s)", what, op, offset + i,
                              static_cast<int>(got[offset + i]), static_cast<int>(pattern(rank, op, i)), rank);
        }
    }
    return {};
}

std::span<std::byte> span_of(const DeviceBuffer &b, size_t n, size_t offset = 0) {
    return {b.as<std::byte>() + offset, n};
}

Bytes download(const DeviceBuffer &b, size_t n) { return from_device<std::byte>(b, n); }

// Waits for a stream without waiting forever: bytes that never arrive fail the test instead of hanging it.
Result<void> wait_stream(cudaStream_t stream, milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const cudaError_t e = cudaStreamQuery(stream);
        if (e == cudaSuccess) return {};
        if (e != cudaErrorNotReady) return make_error("stream: {}", cudaGetErrorString(e));
        if (std::chrono::steady_clock::now() >= deadline) {
            return make_error("stream still busy after {} ms", timeout.count());
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

// A message must name the thing: expects every part in it.
void expect_names(const Result<void> &r, const std::vector<std::string> &parts) {
    ASSERT_FALSE(r.has_value()) << "accepted, expected an error naming " << parts.front();
    for (const std::string &part : parts) {
        EXPECT_NE(r.error().message.find(part), std::string::npos) << "'" << part << "' not in: " << r.error().message;
    }
}

// ---- One GPU, one rank ----

class NcclOneRank : public ::testing::Test {
protected:
    void SetUp() override {
        MEMRA_SKIP_WITHOUT_GPU();
        ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
        // Blocking: it orders after the cudaMemcpy uploads of DeviceBuffer (legacy stream), and they after it.
        ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
        auto id = NcclId::make();
        ASSERT_TRUE(id.has_value()) << id.error().message;
        auto comm = NcclCommunicator::create(*id, 1, 0, 0, stream_);
        ASSERT_TRUE(comm.has_value()) << comm.error().message;
        comm_ = std::move(*comm);
    }
    void TearDown() override {
        comm_.reset();
        if (stream_ != nullptr) cudaStreamDestroy(stream_);
    }

    // An all-gather of n patterned bytes into a separate buffer, compared with the host after the stream.
    Result<void> all_gather_apart(size_t n, int op) {
        DeviceBuffer send = to_device(patterned(n, 0, op));
        DeviceBuffer recv = to_device(Bytes(n, kUnwritten));
        if (auto ok = comm_->all_gather(span_of(send, n), span_of(recv, n)); !ok) return ok;
        if (cudaStreamSynchronize(stream_) != cudaSuccess) return make_error("stream synchronize failed");
        return expect_pattern(download(recv, n), 0, n, 0, op, "all_gather");
    }

    cudaStream_t stream_ = nullptr;
    std::unique_ptr<NcclCommunicator> comm_;
};

TEST_F(NcclOneRank, AllGatherCopiesBytesApartAndInPlace) {
    EXPECT_EQ(comm_->rank(), 0);
    EXPECT_EQ(comm_->size(), 1);
    int op = 0;
    for (size_t n : {size_t{1}, size_t{7}, size_t{17}, size_t{4097}, size_t{1} << 20}) {
        auto apart = all_gather_apart(n, op++);
        EXPECT_TRUE(apart.has_value()) << "n=" << n << ": " << apart.error().message;

        DeviceBuffer buf = to_device(patterned(n, 0, op));
        auto in_place = comm_->all_gather(span_of(buf, n), span_of(buf, n));
        ASSERT_TRUE(in_place.has_value()) << in_place.error().message;
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        auto kept = expect_pattern(download(buf, n), 0, n, 0, op++, "in-place all_gather");
        EXPECT_TRUE(kept.has_value()) << "n=" << n << ": " << kept.error().message;
    }
}

TEST_F(NcclOneRank, BroadcastFromTheRootLeavesItsBytes) {
    for (size_t n : {size_t{1}, size_t{127}, size_t{4097}}) {
        DeviceBuffer buf = to_device(patterned(n, 0, 3));
        auto ok = comm_->broadcast(span_of(buf, n), 0);
        ASSERT_TRUE(ok.has_value()) << ok.error().message;
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        auto kept = expect_pattern(download(buf, n), 0, n, 0, 3, "broadcast");
        EXPECT_TRUE(kept.has_value()) << "n=" << n << ": " << kept.error().message;
    }
}

TEST_F(NcclOneRank, SendToItselfInsideAGroupMovesTheBytes) {
    for (size_t n : {size_t{1}, size_t{4097}}) {
        DeviceBuffer src = to_device(patterned(n, 0, 5));
        DeviceBuffer dst = to_device(Bytes(n, kUnwritten));
        ASSERT_TRUE(comm_->group_start().has_value());
        ASSERT_TRUE(comm_->group_start().has_value());  // nested: only the outermost end enqueues
        ASSERT_TRUE(comm_->send(span_of(src, n), 0).has_value());
        ASSERT_TRUE(comm_->group_end().has_value());
        ASSERT_TRUE(comm_->recv(span_of(dst, n), 0).has_value());
        auto ended = comm_->group_end();
        ASSERT_TRUE(ended.has_value()) << ended.error().message;
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        auto moved = expect_pattern(download(dst, n), 0, n, 0, 5, "recv from itself");
        EXPECT_TRUE(moved.has_value()) << "n=" << n << ": " << moved.error().message;
    }
}

TEST_F(NcclOneRank, BarrierWaitsForTheStream) {
    const size_t n = size_t{1} << 22;
    DeviceBuffer send = to_device(patterned(n, 0, 9));
    DeviceBuffer recv = to_device(Bytes(n, kUnwritten));
    ASSERT_TRUE(comm_->all_gather(span_of(send, n), span_of(recv, n)).has_value());
    auto ok = comm_->barrier();
    ASSERT_TRUE(ok.has_value()) << ok.error().message;
    EXPECT_EQ(cudaStreamQuery(stream_), cudaSuccess);  // the all-gather before it has run
    auto copied = expect_pattern(download(recv, n), 0, n, 0, 9, "all_gather before the barrier");
    EXPECT_TRUE(copied.has_value()) << copied.error().message;
}

// Informational: what one all-gather costs the host (the call, with the non-blocking communicator's poll) and
// the stream, for the message sizes of a decode step's exchanges; and the same copy as a cudaMemcpyAsync.
TEST_F(NcclOneRank, MeasuredAllGatherCost) {
    using Clock = std::chrono::steady_clock;
    for (size_t n : {size_t{4} << 10, size_t{256} << 10, size_t{4} << 20}) {
        DeviceBuffer send = to_device(Bytes(n, std::byte{1}));
        DeviceBuffer recv = to_device(Bytes(n, kUnwritten));
        constexpr int kCalls = 200;
        for (int i = 0; i < 10; ++i) ASSERT_TRUE(comm_->all_gather(span_of(send, n), span_of(recv, n)).has_value());
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        const auto t0 = Clock::now();
        for (int i = 0; i < kCalls; ++i) ASSERT_TRUE(comm_->all_gather(span_of(send, n), span_of(recv, n)).has_value());
        const auto t1 = Clock::now();
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        const auto t2 = Clock::now();
        for (int i = 0; i < kCalls; ++i) {
            ASSERT_EQ(cudaMemcpyAsync(recv.as<std::byte>(), send.as<std::byte>(), n, cudaMemcpyDeviceToDevice, stream_), cudaSuccess);
        }
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        const auto t3 = Clock::now();
        const auto us = [](auto d) { return std::chrono::duration<double, std::micro>(d).count() / kCalls; };
        std::printf("[ measured ] nccl all_gather of %zu bytes, 1 rank: %.1f us per call on the host, %.1f us per call "
                    "until the stream is done; cudaMemcpyAsync of the same: %.1f us\n",
                    n, us(t1 - t0), us(t2 - t0), us(t3 - t2));
    }
}

TEST_F(NcclOneRank, ZeroByteOperationsDoNothing) {
    EXPECT_TRUE(comm_->all_gather({}, {}).has_value());
    EXPECT_TRUE(comm_->broadcast({}, 0).has_value());
    ASSERT_TRUE(comm_->group_start().has_value());
    EXPECT_TRUE(comm_->send({}, 0).has_value());
    EXPECT_TRUE(comm_->recv({}, 0).has_value());
    EXPECT_TRUE(comm_->group_end().has_value());
    EXPECT_TRUE(comm_->barrier().has_value());
    auto after = all_gather_apart(64, 11);
    EXPECT_TRUE(after.has_value()) << after.error().message;
}

TEST_F(NcclOneRank, RefusedArgumentsAreNamedAndTakeNoPart) {
    DeviceBuffer a(64);
    DeviceBuffer b(64);
    expect_names(comm_->all_gather(span_of(a, 4), span_of(b, 5)),
                 {"nccl all_gather of 4 bytes (rank 0 of 1, GPU 0)",
                  "recv holds 5 bytes, expected 1 ranks x 4 bytes = 4"});
    // recv [0, 8) and send [1, 9): overlapping, and not this rank's slot [0, 8).
    expect_names(comm_->all_gather(span_of(a, 8, 1), span_of(a, 8)),
                 {"send overlaps recv but is not this rank's slot"});
    expect_names(comm_->broadcast(span_of(a, 8), 1), {"nccl broadcast", "root 1 is out of range", "of 1 ranks"});
    expect_names(comm_->broadcast(span_of(a, 8), -1), {"root -1 is out of range"});
    expect_names(comm_->send(span_of(a, 8), 1), {"nccl send of 8 bytes to rank 1", "peer 1 is out of range"});
    expect_names(comm_->recv(span_of(a, 8), -1), {"nccl recv of 8 bytes from rank -1", "peer -1 is out of range"});
    expect_names(comm_->send(span_of(a, 8), 0), {"peer 0 is this rank", "only inside a group"});
    expect_names(comm_->recv(span_of(a, 8), 0), {"peer 0 is this rank", "only inside a group"});
    expect_names(comm_->group_end(), {"nccl group_end", "no open group_start"});

    ASSERT_TRUE(comm_->group_start().has_value());
    expect_names(comm_->all_gather(span_of(a, 8), span_of(b, 8)), {"nccl all_gather", "inside a send/recv group"});
    expect_names(comm_->broadcast(span_of(a, 8), 0), {"nccl broadcast", "inside a send/recv group"});
    expect_names(comm_->barrier(), {"nccl barrier", "inside a send/recv group"});
    ASSERT_TRUE(comm_->group_end().has_value());

    // Nothing of the above was enqueued: the next operations are the communicator's first.
    auto after = all_gather_apart(33, 12);
    EXPECT_TRUE(after.has_value()) << after.error().message;
    auto barrier = comm_->barrier();
    EXPECT_TRUE(barrier.has_value()) << barrier.error().message;
}

// A stream of GPU 0 (made current), destroyed with the test however it ends.
struct Gpu0Stream {
    cudaStream_t stream = nullptr;
    Gpu0Stream() {
        EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
        EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    }
    ~Gpu0Stream() {
        if (stream != nullptr) cudaStreamDestroy(stream);
    }
    Gpu0Stream(const Gpu0Stream &) = delete;
    Gpu0Stream &operator=(const Gpu0Stream &) = delete;
};

TEST(NcclComm, CreateRefusesBadArguments) {
    MEMRA_SKIP_WITHOUT_GPU();
    const Gpu0Stream gpu;
    const cudaStream_t stream = gpu.stream;
    auto id = NcclId::make();
    ASSERT_TRUE(id.has_value()) << id.error().message;
    auto bad_rank = NcclCommunicator::create(*id, 2, 2, 0, stream);
    ASSERT_FALSE(bad_rank.has_value());
    EXPECT_NE(bad_rank.error().message.find("rank 2 of 2"), std::string::npos) << bad_rank.error().message;
    auto bad_device = NcclCommunicator::create(*id, 1, 0, 999, stream);
    ASSERT_FALSE(bad_device.has_value());
    EXPECT_NE(bad_device.error().message.find("GPU 999 does not exist"), std::string::npos)
        << bad_device.error().message;

    const std::vector<int> twice = {0, 0};
    const std::vector<cudaStream_t> streams = {stream, stream};
    auto dup = NcclGroup::create(twice, streams);
    ASSERT_FALSE(dup.has_value());
    EXPECT_NE(dup.error().message.find("GPU 0 is given to ranks 0 and 1"), std::string::npos) << dup.error().message;
    const std::vector<int> one = {0};
    auto mismatch = NcclGroup::create(one, streams);
    ASSERT_FALSE(mismatch.has_value());
    EXPECT_NE(mismatch.error().message.find("expected one stream per GPU (1), found 2"), std::string::npos)
        << mismatch.error().message;
    EXPECT_FALSE(NcclGroup::create({}, {}).has_value());
}

// NCCL's init of a non-blocking communicator is polled, so a rank whose peer never calls create() gets an
// error after its timeout (and NCCL's init is aborted) instead of waiting forever.
TEST(NcclComm, RankWithoutItsPeerFailsAfterTheTimeout) {
    MEMRA_SKIP_WITHOUT_GPU();
    const Gpu0Stream gpu;
    const cudaStream_t stream = gpu.stream;
    auto id = NcclId::make();
    ASSERT_TRUE(id.has_value()) << id.error().message;
    const auto start = std::chrono::steady_clock::now();
    auto comm = NcclCommunicator::create(*id, 2, 0, 0, stream, milliseconds(2000));
    const auto waited = std::chrono::steady_clock::now() - start;
    ASSERT_FALSE(comm.has_value()) << "a rank of 2 initialised without its peer";
    expect_names(tl::unexpected(comm.error()), {"nccl init (rank 0 of 2, GPU 0)", "not initialised after 2000 ms"});
    EXPECT_GE(waited, milliseconds(2000));
    EXPECT_LT(waited, milliseconds(60000)) << "the abort after the timeout took too long";
}

// ---- Two or more GPUs: one rank per GPU ----

class NcclGroupTest : public ::testing::Test {
protected:
    static constexpr int kMaxRanks = 8;
    static constexpr milliseconds kTimeout{60000};

    void SetUp() override {
        MEMRA_SKIP_WITHOUT_GPU();
        const int visible = cuda_device_count();
        if (visible < 2) GTEST_SKIP() << "needs at least 2 GPUs, found " << visible;
        const int count = std::min(visible, kMaxRanks);
        for (int d = 0; d < count; ++d) {
            ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
            cudaStream_t s = nullptr;
            ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
            devices_.push_back(d);
            streams_.push_back(s);
        }
        auto group = NcclGroup::create(devices_, streams_, kTimeout);
        ASSERT_TRUE(group.has_value()) << group.error().message;
        group_.emplace(std::move(*group));
    }
    void TearDown() override {
        group_.reset();
        for (size_t i = 0; i < streams_.size(); ++i) {
            cudaSetDevice(devices_[i]);
            cudaStreamDestroy(streams_[i]);
        }
    }

    int n() const { return static_cast<int>(devices_.size()); }

    // Runs fn(rank, communicator) on one thread per rank (its GPU current) and expects every rank to succeed.
    void run_ranks(const std::function<Result<void>(int, NcclCommunicator &)> &fn) {
        std::vector<std::string> failures(static_cast<size_t>(n()));
        std::vector<std::thread> threads;
        for (int r = 0; r < n(); ++r) {
            threads.emplace_back([&, r] {
                cudaSetDevice(devices_[static_cast<size_t>(r)]);
                auto ok = fn(r, group_->communicator(r));
                if (!ok) failures[static_cast<size_t>(r)] = ok.error().message;
            });
        }
        for (std::thread &t : threads) t.join();
        for (int r = 0; r < n(); ++r) EXPECT_EQ(failures[static_cast<size_t>(r)], "") << "rank " << r;
    }

    std::vector<int> devices_;
    std::vector<cudaStream_t> streams_;
    std::optional<NcclGroup> group_;
};

TEST_F(NcclGroupTest, AllGatherOfRankDistinctBytesIsExact) {
    run_ranks([&](int me, NcclCommunicator &comm) -> Result<void> {
        const auto ranks = static_cast<size_t>(n());
        // Refused calls on one rank only: had they been enqueued, the ranks' calls would no longer match.
        if (me == 0) {
            DeviceBuffer junk(16);
            if (comm.all_gather(span_of(junk, 4), span_of(junk, 5))) return make_error("a bad size was accepted");
            if (comm.broadcast(span_of(junk, 4), n())) return make_error("a bad root was accepted");
        }
        int op = 0;
        for (size_t bytes : {size_t{1}, size_t{7}, size_t{4097}, size_t{1} << 20}) {
            for (bool in_place : {false, true}) {
                Bytes init(ranks * bytes, kUnwritten);
                if (in_place) {
                    const Bytes own = patterned(bytes, me, op);
                    std::copy(own.begin(), own.end(), init.begin() + static_cast<std::ptrdiff_t>(me * bytes));
                }
                DeviceBuffer recv = to_device(init);
                DeviceBuffer send = to_device(patterned(bytes, me, op));
                const std::span<std::byte> own_slot = span_of(recv, bytes, static_cast<size_t>(me) * bytes);
                if (auto ok = comm.all_gather(in_place ? own_slot : span_of(send, bytes), span_of(recv, ranks * bytes));
                    !ok) {
                    return ok;
                }
                if (auto ok = comm.barrier(); !ok) return ok;
                const Bytes got = download(recv, ranks * bytes);
                for (int r = 0; r < n(); ++r) {
                    if (auto ok = expect_pattern(got, static_cast<size_t>(r) * bytes, bytes, r, op, "all_gather slot");
                        !ok) {
                        return ok;
                    }
                }
                ++op;
            }
        }
        return {};
    });
}

// Rank r sends to r + 1 and receives from r - 1 in one group: a ring shift, which deadlocks unless the
// sends and recvs are enqueued together.
TEST_F(NcclGroupTest, RingShiftWithGroupedSendRecvIsExact) {
    run_ranks([&](int me, NcclCommunicator &comm) -> Result<void> {
        const int next = (me + 1) % n();
        const int prev = (me + n() - 1) % n();
        int op = 0;
        for (size_t bytes : {size_t{1}, size_t{4097}, size_t{1} << 20}) {
            DeviceBuffer src = to_device(patterned(bytes, me, op));
            DeviceBuffer dst = to_device(Bytes(bytes, kUnwritten));
            if (auto ok = comm.group_start(); !ok) return ok;
            if (auto ok = comm.send(span_of(src, bytes), next); !ok) return ok;
            if (auto ok = comm.recv(span_of(dst, bytes), prev); !ok) return ok;
            if (auto ok = comm.group_end(); !ok) return ok;
            if (auto ok = comm.barrier(); !ok) return ok;
            if (auto ok = expect_pattern(download(dst, bytes), 0, bytes, prev, op, "ring recv"); !ok) return ok;
            ++op;
        }
        return {};
    });
}

// The documented single-thread use: one thread opens a group on every rank, posts every rank's send and
// recv, and closes the groups; the last group_end() enqueues all of them.
TEST_F(NcclGroupTest, OneThreadDrivesTheRingShiftInsideGroups) {
    const size_t bytes = 4097;
    std::vector<DeviceBuffer> src;
    std::vector<DeviceBuffer> dst;
    for (int r = 0; r < n(); ++r) {
        ASSERT_EQ(cudaSetDevice(devices_[static_cast<size_t>(r)]), cudaSuccess);
        src.push_back(to_device(patterned(bytes, r, 21)));
        dst.push_back(to_device(Bytes(bytes, kUnwritten)));
    }
    for (int r = 0; r < n(); ++r) ASSERT_TRUE(group_->communicator(r).group_start().has_value());
    for (int r = 0; r < n(); ++r) {
        NcclCommunicator &comm = group_->communicator(r);
        const auto i = static_cast<size_t>(r);
        ASSERT_TRUE(comm.send(span_of(src[i], bytes), (r + 1) % n()).has_value());
        ASSERT_TRUE(comm.recv(span_of(dst[i], bytes), (r + n() - 1) % n()).has_value());
    }
    for (int r = 0; r < n(); ++r) {
        auto ok = group_->communicator(r).group_end();
        ASSERT_TRUE(ok.has_value()) << "rank " << r << ": " << ok.error().message;
    }
    for (int r = 0; r < n(); ++r) {
        const auto i = static_cast<size_t>(r);
        auto done = wait_stream(streams_[i], kTimeout);
        ASSERT_TRUE(done.has_value()) << "rank " << r << ": " << done.error().message;
        ASSERT_EQ(cudaSetDevice(devices_[i]), cudaSuccess);
        auto ok = expect_pattern(download(dst[i], bytes), 0, bytes, (r + n() - 1) % n(), 21, "ring recv");
        EXPECT_TRUE(ok.has_value()) << "rank " << r << ": " << ok.error().message;
    }
}

TEST_F(NcclGroupTest, BroadcastFromEveryRootIsExact) {
    run_ranks([&](int me, NcclCommunicator &comm) -> Result<void> {
        int op = 0;
        for (int root = 0; root < n(); ++root) {
            for (size_t bytes : {size_t{3}, size_t{1} << 20}) {
                // Every rank starts with its own bytes; afterwards all hold the root's.
                DeviceBuffer buf = to_device(patterned(bytes, me == root ? root : 100 + me, op));
                if (auto ok = comm.broadcast(span_of(buf, bytes), root); !ok) return ok;
                if (auto ok = comm.barrier(); !ok) return ok;
                if (auto ok = expect_pattern(download(buf, bytes), 0, bytes, root, op, "broadcast"); !ok) return ok;
                ++op;
            }
        }
        return {};
    });
}

}  // namespace
}  // namespace memra::cuda

#endif  // MEMRA_HAVE_NCCL
