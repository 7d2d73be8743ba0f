// The NCCL communicator: parallel::Communicator across GPUs, one rank per GPU, over ncclAllGather /
// ncclBroadcast / ncclSend / ncclRecv on bytes (ncclUint8), never a reduction (DETERMINISM.md rule 2).
// Buffers are device pointers and every operation only enqueues on the rank's stream: "complete" in
// comm.h means enqueued here, except for barrier(), which waits until the stream has run everything
// before it. Communicators are non-blocking (NCCL's blocking = 0), so every wait (init, an NCCL call still
// in progress, barrier) is a poll bounded by the timeout, and a timeout or an NCCL error aborts the
// communicator instead of hanging.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/result.h"
#include "parallel/comm.h"

struct ncclComm;  // nccl.h's communicator; only the .cpp includes nccl.h

namespace memra::cuda {

// The rendezvous token of one NCCL communicator (an ncclUniqueId, opaque): made once, by one rank or by
// the process that starts the ranks, and handed to every rank's create().
struct NcclId {
    std::array<char, 128> bytes{};

    static Result<NcclId> make();
};

// One rank of an NCCL communicator. Collectives are matched by call order as comm.h says; the checks that
// refuse a call (sizes, overlap, root, peer, a collective inside a group) run before any NCCL call, so a
// refused call enqueues nothing and takes no part in the count. Zero-byte operations do nothing.
//
// Groups: group_start() opens an NCCL group (ncclGroupStart) and the outermost group_end() closes it
// (ncclGroupEnd), which enqueues the group's sends and recvs together. NCCL keeps the open group per host
// thread, so a group starts and ends on one thread, and a send to or recv from this rank itself is allowed
// only inside a group (with its matching recv or send there). Outside a group, a send enqueues a kernel
// that waits on the GPU for the peer's recv.
//
// Failures: an NCCL call that fails, or is still in progress after the timeout, aborts the communicator
// (ncclCommAbort) and is returned as an Error naming the operation, its bytes, the rank and NCCL's reason;
// every later call returns "communicator aborted" with that reason. A failure inside a group aborts at the
// outermost group_end().
//
// The operations allocate nothing here (the barrier's scratch bytes are made by create()). NCCL's own
// non-blocking path (2.2x sources) runs each enqueue, every outermost ncclGroupEnd, on a host thread it
// starts and reports ncclInProgress, which the operation then polls: the price of waits that can end.
//
// One thread at a time per communicator. The stream must outlive the communicator.
class NcclCommunicator final : public parallel::Communicator {
public:
    static constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(5);

    // Rank `rank` of `n_ranks` on GPU `device`, enqueueing on `stream` (a stream of that GPU). Every rank
    // of the communicator calls create() with the same id and n_ranks, each from its own thread or process;
    // create() returns once all have joined, or fails after `timeout`. Leaves `device` current on the
    // calling thread (NCCL takes the device from it). `timeout` also bounds every later wait.
    static Result<std::unique_ptr<NcclCommunicator>> create(const NcclId &id, int n_ranks, int rank, int device,
                                                            cudaStream_t stream,
                                                            std::chrono::milliseconds timeout = kDefaultTimeout);
    // Finalizes and destroys the NCCL communicator (flushing what is enqueued, waiting at most the timeout),
    // or aborts it if it failed or the flush does not finish; then frees the scratch bytes.
    ~NcclCommunicator() override;
    NcclCommunicator(const NcclCommunicator &) = delete;
    NcclCommunicator &operator=(const NcclCommunicator &) = delete;

    int rank() const override { return rank_; }
    int size() const override { return n_ranks_; }

    Result<void> all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override;
    Result<void> broadcast(std::span<std::byte> buf, int root) override;
    // A one-byte all-gather of the scratch bytes, then waits (bounded by the timeout) until the stream has
    // run it and everything enqueued before it: the only operation that waits for the GPU.
    Result<void> barrier() override;
    Result<void> send(std::span<const std::byte> buf, int peer) override;
    Result<void> recv(std::span<std::byte> buf, int peer) override;
    Result<void> group_start() override;
    Result<void> group_end() override;

private:
    friend class NcclGroup;
    struct Op;

    NcclCommunicator(ncclComm *comm, std::byte *scratch, int n_ranks, int rank, int device, cudaStream_t stream,
                     std::chrono::milliseconds timeout);

    bool aborted() const { return comm_ == nullptr; }
    std::string where(const Op &op) const;
    tl::unexpected<Error> aborted_error(const Op &op) const;
    tl::unexpected<Error> fail(const Op &op, const std::string &what);
    // `result` is an ncclResult_t (nccl.h stays out of this header).
    std::string nccl_reason(int result) const;
    Result<void> settle(const Op &op, int result);
    Result<void> ensure_ready(const Op &op);
    Result<void> check_peer(const Op &op, int peer) const;

    ncclComm *comm_;     // null once aborted
    std::byte *scratch_;  // [n_ranks] device bytes: the barrier's all-gather
    int n_ranks_;
    int rank_;
    int device_;
    cudaStream_t stream_;
    std::chrono::milliseconds timeout_;
    int group_depth_ = 0;
    std::string group_failure_;  // the first failure inside the open group, reported at its group_end
    std::string abort_reason_;
};

// Several GPUs of one process, one NCCL communicator (rank r on devices[r], enqueueing on streams[r]) per
// GPU, all made from one NcclId and initialised from the calling thread inside one ncclGroupStart /
// ncclGroupEnd (NCCL's way to create several ranks from one thread). An operation may wait on the host
// until the other ranks make theirs (NCCL connects peers on first use), so the ranks' operations are then
// issued from one thread per rank. One thread may drive several ranks only for sends and recvs: it opens
// a group on each of those ranks, posts their sends and recvs, and closes the groups; the last
// group_end() enqueues them all. The rank threads must be done with the communicators before the group is
// destroyed.
class NcclGroup {
public:
    // devices: distinct visible GPUs, at least one; streams: one per device, a stream of that device.
    // Leaves the calling thread's current device as it was.
    static Result<NcclGroup> create(std::span<const int> devices, std::span<const cudaStream_t> streams,
                                    std::chrono::milliseconds timeout = NcclCommunicator::kDefaultTimeout);

    NcclGroup(NcclGroup &&) noexcept = default;
    NcclGroup &operator=(NcclGroup &&) noexcept = default;

    int size() const { return static_cast<int>(comms_.size()); }
    // Rank r's communicator, owned by the group; r in [0, size()).
    NcclCommunicator &communicator(int rank);
    // The communicators in rank order, owned by the caller from now on (the group is left empty).
    std::vector<std::unique_ptr<parallel::Communicator>> release();

private:
    explicit NcclGroup(std::vector<std::unique_ptr<NcclCommunicator>> comms) : comms_(std::move(comms)) {}

    std::vector<std::unique_ptr<NcclCommunicator>> comms_;  // [rank]
};

}  // namespace memra::cuda
