// The communicator: the only way ranks exchange data (ARCHITECTURE.md "Parallelism"). Collectives are
// all-gather, broadcast and barrier; point-to-point is send/recv, batched NCCL-style in groups. There is
// deliberately no all-reduce: row-parallel sums are finished by the canonical block tree after an
// all-gather (DETERMINISM.md rule 2). InProcessGroup runs N ranks as threads of one process (CPU ranks,
// several ranks sharing one GPU); an NCCL communicator implements the same interface.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "core/function_ref.h"
#include "core/result.h"

namespace memra::parallel {

class Communicator;

// What a group runs on each rank: fn(rank, that rank's communicator).
using RankFn = FunctionRef<Result<void>(int rank, Communicator &comm)>;

// One rank's handle on its group. Bytes are opaque and copied bit for bit, so every call takes byte spans;
// typed data goes through std::as_bytes / std::as_writable_bytes. Every call returns an Error instead of
// waiting forever: on bad arguments (this rank only), on a collective whose ranks disagree (every rank of
// it gets the same message), and once the group is aborted (the message carries the reason).
//
// Collectives are matched by call order, as in NCCL: the k-th collective call of every rank forms one
// operation, and every rank must make the same call with the same byte count (and root). A call refused
// for bad arguments takes no part: the rank's next valid collective is still its k-th.
//
// Point-to-point: the k-th send from rank a to rank b meets the k-th recv on b from a (FIFO per ordered
// pair); a send and its recv must have the same size, else both fail. Outside a group a send returns once
// the peer's recv has taken the bytes and a recv once they have arrived, so two ranks that both send first
// deadlock, exactly as on NCCL streams. Between group_start() and group_end() sends and recvs are only
// recorded; group_end() posts all of them and returns when all are complete, so a pairwise exchange or a
// ring shift is one group per rank. Collectives are not allowed inside a group.
//
// Memory: the in-process implementation takes host pointers, which must stay valid and untouched (recv) or
// unmodified (send) until the call returns. A device implementation takes device pointers and enqueues on a
// stream; it will extend this interface with an opaque stream handle argument (e.g. `void *stream`, a
// cudaStream_t for NCCL) on each call, completion then meaning "enqueued", and keep the byte-span shape,
// which maps one to one onto ncclAllGather / ncclBroadcast / ncclSend / ncclRecv with ncclUint8.
class Communicator {
public:
    virtual ~Communicator() = default;

    virtual int rank() const = 0;
    virtual int size() const = 0;

    // recv.size() == size() * send.size(); rank r's send lands at recv[r * send.size(), ...) on every rank.
    // In place: send may be exactly this rank's slot of recv (recv.subspan(rank() * n, n)); any other
    // overlap of send and recv is refused.
    virtual Result<void> all_gather(std::span<const std::byte> send, std::span<std::byte> recv) = 0;
    // After the call every rank's buf holds root's buf; all ranks pass the same root and size.
    virtual Result<void> broadcast(std::span<std::byte> buf, int root) = 0;
    // Blocks until every rank of the group has entered its matching barrier.
    virtual Result<void> barrier() = 0;

    virtual Result<void> send(std::span<const std::byte> buf, int peer) = 0;
    virtual Result<void> recv(std::span<std::byte> buf, int peer) = 0;
    // Groups nest; the operations run at the outermost group_end(), which reports the first error among
    // them after completing (or failing) all of them, so no peer is left waiting on a skipped operation.
    virtual Result<void> group_start() = 0;
    virtual Result<void> group_end() = 0;
};

// N ranks in one process, each driven by its own thread. All slots are allocated by create(), so the
// operations allocate nothing (a send/recv group larger than 2 * n operations grows its buffer once).
// Synchronisation is one mutex per group plus one condition variable per rank. The rank threads are
// persistent: the first run() starts them and every run() after it only wakes them, so a run allocates
// nothing and starts no thread.
//
// Hangs become errors: abort(reason) makes every rank blocked in, or later entering, an operation fail
// with the reason; and a group in which every rank is blocked in an operation (or has returned from its
// run() function) with none of them able to proceed is aborted as a deadlock, naming what each rank waits
// for. An aborted group stays aborted.
class InProcessGroup {
public:
    // How the group moves bytes between ranks' buffers: std::memcpy for host memory (nullptr), or a copy that
    // also reaches device memory (ranks sharing one GPU: cuda::cuda_rank_copy, which orders after the work
    // queued on the device). Must be callable from every rank thread at once.
    using ByteCopy = void (*)(void *dst, const void *src, size_t n);

    // 1 <= n_ranks <= kMaxRanks.
    static Result<InProcessGroup> create(int n_ranks, ByteCopy copy = nullptr);

    // A bound only to refuse absurd requests before allocating; each rank is a thread.
    static constexpr int kMaxRanks = 4096;

    InProcessGroup(InProcessGroup &&) noexcept;
    InProcessGroup &operator=(InProcessGroup &&) noexcept;
    ~InProcessGroup();  // stops and joins the rank threads; no rank may still be inside an operation

    int size() const;
    // Rank r's communicator, owned by the group; r in [0, size()). One thread at a time per communicator.
    Communicator &communicator(int rank);

    void abort(const std::string &reason);
    bool aborted() const;

    // Runs fn(r, communicator(r)) for every rank on rank r's thread (the same thread on every run) and
    // returns when all have returned. When a rank fails (returns an error or throws), the group is aborted
    // with "rank r: <message>" so the others are released. Returns the first failure by rank order, prefixed
    // "rank r: ", preferring ranks that failed on their own over ranks that only saw the abort. After a
    // successful run the group can run again. A rank thread that cannot be started fails its rank.
    Result<void> run(RankFn fn);

private:
    struct State;
    explicit InProcessGroup(std::unique_ptr<State> state);
    std::unique_ptr<State> state_;
};

// InProcessGroup::create(n_ranks) then run(fn).
Result<void> run_ranks(int n_ranks, RankFn fn);

}  // namespace memra::parallel
