// NcclCommunicator and NcclGroup (nccl_comm.h): the argument checks of parallel::InProcessGroup, then one
// NCCL call per operation on the rank's stream. The communicators are non-blocking, so a call may return
// ncclInProgress; it is then polled (ncclCommGetAsyncError) until NCCL has finished enqueueing, as NCCL
// requires before the next call, and every such poll ends at the timeout.
#include "backend/cuda/nccl_comm.h"

#ifdef MEMRA_HAVE_NCCL  // without NCCL (CMakeLists.txt) this file compiles to nothing

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"

namespace memra::cuda {
namespace {

using Clock = std::chrono::steady_clock;

static_assert(sizeof(ncclUniqueId) == sizeof(NcclId::bytes), "NcclId holds exactly one ncclUniqueId");

// NVLink SHARP (NVLS) is NCCL's use of NVSwitch multicast: its reductions run inside the switch in an
// order the program does not control (this project never reduces across ranks: DETERMINISM.md rule 2),
// and the GPU machines' notes forbid multicast, which can take a shared host's GPUs out of service. NCCL
// reads NCCL_NVLS_ENABLE when it initialises, so it is set before the first NCCL call, unless the
// environment already says otherwise. setenv is not safe against a concurrent getenv: once per process,
// and every thread of ours waits here before calling NCCL.
void keep_nvls_off() {
    static std::once_flag once;
    std::call_once(once, [] { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); });
}

// Paces a polling loop: yields at first (an NCCL call in progress usually finishes within microseconds),
// then sleeps, so that a long wait (init, a barrier behind a long step) does not hold a core.
class Backoff {
public:
    void pause() {
        if (polls_ < kYields) {
            ++polls_;
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
    }

private:
    static constexpr int kYields = 1000;
    int polls_ = 0;
};

// Polls comm's state until it is no longer ncclInProgress or the deadline has passed. Returns the state
// (ncclInProgress at the deadline), or the failure of the query itself.
ncclResult_t poll_state(ncclComm_t comm, Clock::time_point deadline) {
    Backoff backoff;
    for (;;) {
        ncclResult_t state = ncclInProgress;
        if (const ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) return r;
        if (state != ncclInProgress || Clock::now() >= deadline) return state;
        backoff.pause();
    }
}

std::string cuda_reason(cudaError_t e) { return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e)); }

// NCCL's word for a result plus its last error message, which says what failed.
std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
    const char *last = ncclGetLastError(comm);
    if (last == nullptr || *last == '\0') return ncclGetErrorString(r);
    return fmt::format("{} ({})", ncclGetErrorString(r), last);
}

ncclConfig_t nonblocking_config() {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    return config;
}

ncclUniqueId unique_id(const NcclId &id) {
    ncclUniqueId uid;
    std::memcpy(&uid, id.bytes.data(), sizeof(uid));
    return uid;
}

// Makes `device` current after checking that it is visible and that `stream` is one of its streams.
Result<void> use_device(int device, cudaStream_t stream, const std::string &who) {
    int count = 0;
    if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
        (void)cudaGetLastError();  // not sticky: later calls should not see it
        return make_error("{}: no CUDA device ({})", who, cuda_reason(e));
    }
    if (device < 0 || device >= count) return make_error("{}: GPU {} does not exist ({} visible)", who, device, count);
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
        return make_error("{}: GPU {}: {}", who, device, cuda_reason(e));
    }
    int stream_device = -1;
    if (cudaError_t e = cudaStreamGetDevice(stream, &stream_device); e != cudaSuccess) {
        return make_error("{}: the stream of GPU {}: {}", who, device, cuda_reason(e));
    }
    if (stream_device != device) {
        return make_error("{}: the stream belongs to GPU {}, expected a stream of GPU {}", who, stream_device, device);
    }
    return {};
}

// A rank's barrier scratch: n_ranks bytes on the current device, zeroed (on the rank's stream, so before any
// barrier) only so that memory checkers see them written: their values are never read.
Result<std::byte *> alloc_scratch(int n_ranks, cudaStream_t stream, const std::string &who) {
    void *p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, static_cast<size_t>(n_ranks)); e != cudaSuccess) {
        return make_error("{}: {} bytes of barrier scratch: {}", who, n_ranks, cuda_reason(e));
    }
    if (cudaError_t e = cudaMemsetAsync(p, 0, static_cast<size_t>(n_ranks), stream); e != cudaSuccess) {
        cudaFree(p);
        return make_error("{}: zeroing the barrier scratch: {}", who, cuda_reason(e));
    }
    return static_cast<std::byte *>(p);
}

void free_on(int device, void *p) {
    int current = 0;
    const bool restore = cudaGetDevice(&current) == cudaSuccess;
    cudaSetDevice(device);
    cudaFree(p);
    if (restore) cudaSetDevice(current);
}

}  // namespace

// What an operation is, for its messages: "all_gather of 4096 bytes", "send of 16 bytes to rank 2".
struct NcclCommunicator::Op {
    const char *name;
    size_t bytes = 0;
    bool has_bytes = false;
    const char *peer_role = nullptr;  // "to rank", "from rank", "from root"; nullptr: no peer
    int peer = 0;
};

Result<NcclId> NcclId::make() {
    keep_nvls_off();
    ncclUniqueId uid;
    if (const ncclResult_t r = ncclGetUniqueId(&uid); r != ncclSuccess) {
        return make_error("nccl unique id: {}", nccl_text(r, nullptr));
    }
    NcclId id;
    std::memcpy(id.bytes.data(), &uid, sizeof(uid));
    return id;
}

NcclCommunicator::NcclCommunicator(ncclComm *comm, std::byte *scratch, int n_ranks, int rank, int device,
                                   cudaStream_t stream, std::chrono::milliseconds timeout)
    : comm_(comm), scratch_(scratch), n_ranks_(n_ranks), rank_(rank), device_(device), stream_(stream),
      timeout_(timeout) {}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(const NcclId &id, int n_ranks, int rank,
                                                                   int device, cudaStream_t stream,
                                                                   std::chrono::milliseconds timeout) {
    const std::string who = fmt::format("nccl init (rank {} of {}, GPU {})", rank, n_ranks, device);
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks) {
        return make_error("{}: expected at least 1 rank and a rank in [0, {})", who, n_ranks);
    }
    if (timeout.count() <= 0) return make_error("{}: expected a positive timeout, found {} ms", who, timeout.count());
    if (auto ok = use_device(device, stream, who); !ok) return tl::unexpected(ok.error());
    auto scratch = alloc_scratch(n_ranks, stream, who);
    if (!scratch) return tl::unexpected(scratch.error());

    keep_nvls_off();
    ncclConfig_t config = nonblocking_config();
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, n_ranks, unique_id(id), rank, &config);
    if (r == ncclInProgress) r = poll_state(comm, Clock::now() + timeout);
    if (r != ncclSuccess) {
        const std::string reason =
            r == ncclInProgress ? fmt::format("not initialised after {} ms (did all {} ranks call create with this "
                                              "id?); aborted",
                                              timeout.count(), n_ranks)
                                : nccl_text(r, comm);
        if (comm != nullptr) ncclCommAbort(comm);
        cudaFree(*scratch);
        return make_error("{}: {}", who, reason);
    }
    return std::unique_ptr<NcclCommunicator>(
        new NcclCommunicator(comm, *scratch, n_ranks, rank, device, stream, timeout));
}

NcclCommunicator::~NcclCommunicator() {
    if (comm_ != nullptr) {
        if (group_depth_ > 0) {
            // Destroyed inside an open group (a rank that returned early): close NCCL's group on this thread and
            // abort, since the group's sends and recvs may have no partner.
            ncclGroupEnd();
            ncclCommAbort(comm_);
        } else {
            // An earlier group may still be finishing its enqueue; then finalize flushes what is enqueued. A
            // non-blocking destroy completes on NCCL's own thread: the handle is not touched after it.
            const Clock::time_point deadline = Clock::now() + timeout_;
            ncclResult_t r = poll_state(comm_, deadline);
            if (r == ncclSuccess) r = ncclCommFinalize(comm_);
            if (r == ncclInProgress) r = poll_state(comm_, deadline);
            if (r == ncclSuccess) {
                ncclCommDestroy(comm_);
            } else {
                ncclCommAbort(comm_);
            }
        }
    }
    free_on(device_, scratch_);
}

std::string NcclCommunicator::where(const Op &op) const {
    std::string what = op.name;
    if (op.has_bytes) what += fmt::format(" of {} bytes", op.bytes);
    if (op.peer_role != nullptr) what += fmt::format(" {} {}", op.peer_role, op.peer);
    return fmt::format("nccl {} (rank {} of {}, GPU {})", what, rank_, n_ranks_, device_);
}

tl::unexpected<Error> NcclCommunicator::aborted_error(const Op &op) const {
    return make_error("{}: communicator aborted: {}", where(op), abort_reason_);
}

std::string NcclCommunicator::nccl_reason(int result) const {
    return nccl_text(static_cast<ncclResult_t>(result), comm_);
}

// An NCCL failure leaves this rank out of step with its peers, so the communicator is aborted; inside a
// group NCCL's open group still holds it, so the abort waits for the outermost group_end().
tl::unexpected<Error> NcclCommunicator::fail(const Op &op, const std::string &what) {
    std::string message = fmt::format("{}: {}", where(op), what);
    if (group_depth_ > 0) {
        if (group_failure_.empty()) group_failure_ = message;
        return tl::unexpected(Error{std::move(message)});
    }
    ncclCommAbort(comm_);
    comm_ = nullptr;
    abort_reason_ = message;
    return make_error("{}; communicator aborted", message);
}

// `result` is what an NCCL call returned; ncclInProgress is polled until NCCL has finished the call.
Result<void> NcclCommunicator::settle(const Op &op, int result) {
    auto r = static_cast<ncclResult_t>(result);
    if (r == ncclInProgress) r = poll_state(comm_, Clock::now() + timeout_);
    if (r == ncclSuccess) return {};
    if (r == ncclInProgress) return fail(op, fmt::format("still in progress after {} ms", timeout_.count()));
    return fail(op, nccl_reason(r));
}

// NCCL refuses a call while the communicator's previous one is in progress: one that another rank's
// group_end() on this thread launched, or one whose NCCL thread has not yet reported. An error here is
// an earlier operation failing on the GPU or in NCCL's threads.
Result<void> NcclCommunicator::ensure_ready(const Op &op) {
    ncclResult_t state = ncclInProgress;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) return fail(op, nccl_reason(r));
    if (state == ncclSuccess || state == ncclInProgress) return settle(op, state);
    return fail(op, fmt::format("an earlier operation failed: {}", nccl_reason(state)));
}

Result<void> NcclCommunicator::check_peer(const Op &op, int peer) const {
    if (peer < 0 || peer >= n_ranks_) {
        return make_error("{}: peer {} is out of range for a communicator of {} ranks", where(op), peer, n_ranks_);
    }
    if (peer == rank_ && group_depth_ == 0) {
        return make_error("{}: peer {} is this rank; a rank sends to or receives from itself only inside a group "
                          "(group_start ... group_end), with the matching recv or send",
                          where(op), peer);
    }
    return {};
}

Result<void> NcclCommunicator::all_gather(std::span<const std::byte> send, std::span<std::byte> recv) {
    const size_t bytes = send.size();
    const Op op{"all_gather", bytes, true};
    if (group_depth_ > 0) return make_error("{}: called inside a send/recv group (before group_end)", where(op));
    const size_t expected = static_cast<size_t>(n_ranks_) * bytes;
    if (recv.size() != expected) {
        return make_error("{}: recv holds {} bytes, expected {} ranks x {} bytes = {}", where(op), recv.size(),
                          n_ranks_, bytes, expected);
    }
    if (bytes > 0) {
        const auto s = reinterpret_cast<uintptr_t>(send.data());
        const auto r = reinterpret_cast<uintptr_t>(recv.data());
        const std::byte *own_slot = recv.data() + static_cast<size_t>(rank_) * bytes;
        if (s < r + recv.size() && r < s + bytes && send.data() != own_slot) {
            return make_error("{}: send overlaps recv but is not this rank's slot (in place, rank {} passes recv "
                              "bytes [{}, {}) as send)",
                              where(op), rank_, static_cast<size_t>(rank_) * bytes,
                              static_cast<size_t>(rank_ + 1) * bytes);
        }
    }
    if (aborted()) return aborted_error(op);
    if (bytes == 0) return {};
    if (auto ok = ensure_ready(op); !ok) return ok;
    return settle(op, ncclAllGather(send.data(), recv.data(), bytes, ncclUint8, comm_, stream_));
}

Result<void> NcclCommunicator::broadcast(std::span<std::byte> buf, int root) {
    const Op op{"broadcast", buf.size(), true, "from root", root};
    if (group_depth_ > 0) return make_error("{}: called inside a send/recv group (before group_end)", where(op));
    if (root < 0 || root >= n_ranks_) {
        return make_error("{}: root {} is out of range for a communicator of {} ranks", where(op), root, n_ranks_);
    }
    if (aborted()) return aborted_error(op);
    if (buf.empty()) return {};
    if (auto ok = ensure_ready(op); !ok) return ok;
    return settle(op, ncclBroadcast(buf.data(), buf.data(), buf.size(), ncclUint8, root, comm_, stream_));
}

Result<void> NcclCommunicator::barrier() {
    const Op op{"barrier"};
    if (group_depth_ > 0) return make_error("{}: called inside a send/recv group (before group_end)", where(op));
    if (aborted()) return aborted_error(op);
    if (auto ok = ensure_ready(op); !ok) return ok;
    // In place: this rank's byte is its own slot of the scratch.
    if (auto ok = settle(op, ncclAllGather(scratch_ + rank_, scratch_, 1, ncclUint8, comm_, stream_)); !ok) return ok;
    const Clock::time_point deadline = Clock::now() + timeout_;
    Backoff backoff;
    for (;;) {
        const cudaError_t e = cudaStreamQuery(stream_);
        if (e == cudaSuccess) return {};
        if (e != cudaErrorNotReady) return fail(op, fmt::format("waiting for the stream: {}", cuda_reason(e)));
        ncclResult_t state = ncclSuccess;
        if (const ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
            return fail(op, nccl_reason(r));
        }
        if (state != ncclSuccess && state != ncclInProgress) return fail(op, nccl_reason(state));
        if (Clock::now() >= deadline) {
            return fail(op, fmt::format("the stream has not reached the barrier after {} ms (a rank that has not "
                                        "entered it, or work before it that does not finish)",
                                        timeout_.count()));
        }
        backoff.pause();
    }
}

Result<void> NcclCommunicator::send(std::span<const std::byte> buf, int peer) {
    const Op op{"send", buf.size(), true, "to rank", peer};
    if (auto ok = check_peer(op, peer); !ok) return ok;
    if (aborted()) return aborted_error(op);
    if (buf.empty()) return {};
    if (auto ok = ensure_ready(op); !ok) return ok;
    return settle(op, ncclSend(buf.data(), buf.size(), ncclUint8, peer, comm_, stream_));
}

Result<void> NcclCommunicator::recv(std::span<std::byte> buf, int peer) {
    const Op op{"recv", buf.size(), true, "from rank", peer};
    if (auto ok = check_peer(op, peer); !ok) return ok;
    if (aborted()) return aborted_error(op);
    if (buf.empty()) return {};
    if (auto ok = ensure_ready(op); !ok) return ok;
    return settle(op, ncclRecv(buf.data(), buf.size(), ncclUint8, peer, comm_, stream_));
}

// An aborted communicator never has a group open (an abort inside a group waits for its group_end), so
// group_start() on one opens nothing, and group_end() without an open group reports the abort.
Result<void> NcclCommunicator::group_start() {
    const Op op{"group_start"};
    if (aborted()) return aborted_error(op);
    if (group_depth_ > 0) {
        ++group_depth_;
        return {};
    }
    if (auto ok = ensure_ready(op); !ok) return ok;
    if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return fail(op, nccl_reason(r));
    group_depth_ = 1;
    return {};
}

Result<void> NcclCommunicator::group_end() {
    const Op op{"group_end"};
    if (group_depth_ == 0) {
        if (aborted()) return aborted_error(op);
        return make_error("{}: no open group_start", where(op));
    }
    if (--group_depth_ > 0) return {};
    const ncclResult_t r = ncclGroupEnd();
    if (!group_failure_.empty()) {
        // NCCL drops a group in which a call failed; the first failure is the reason.
        const std::string failure = std::move(group_failure_);
        group_failure_.clear();
        return fail(op, fmt::format("the group failed: {}", failure));
    }
    return settle(op, r);
}

Result<NcclGroup> NcclGroup::create(std::span<const int> devices, std::span<const cudaStream_t> streams,
                                    std::chrono::milliseconds timeout) {
    const size_t n = devices.size();
    const int n_ranks = static_cast<int>(n);
    const std::string who = fmt::format("nccl group of GPUs [{}]", fmt::join(devices, ", "));
    if (n == 0) return make_error("nccl group: expected at least one GPU, found none");
    if (streams.size() != n) {
        return make_error("{}: expected one stream per GPU ({}), found {}", who, n, streams.size());
    }
    for (size_t r = 0; r < n; ++r) {
        for (size_t q = 0; q < r; ++q) {
            if (devices[q] == devices[r]) {
                return make_error("{}: GPU {} is given to ranks {} and {}; NCCL runs one rank per GPU (ranks sharing "
                                  "a GPU: parallel::InProcessGroup)",
                                  who, devices[r], q, r);
            }
        }
    }
    if (timeout.count() <= 0) return make_error("{}: expected a positive timeout, found {} ms", who, timeout.count());

    int caller_device = 0;
    if (cudaError_t e = cudaGetDevice(&caller_device); e != cudaSuccess) {
        (void)cudaGetLastError();
        return make_error("{}: no CUDA device ({})", who, cuda_reason(e));
    }
    std::vector<std::byte *> scratch(n, nullptr);
    std::vector<ncclComm_t> comms(n, nullptr);
    // On failure: abort what was created, free the scratch, give the caller back its device.
    auto undo = [&](const std::string &message) {
        for (ncclComm_t c : comms) {
            if (c != nullptr) ncclCommAbort(c);
        }
        for (size_t r = 0; r < n; ++r) {
            if (scratch[r] != nullptr) free_on(devices[r], scratch[r]);
        }
        cudaSetDevice(caller_device);
        return tl::unexpected(Error{message});
    };

    for (size_t r = 0; r < n; ++r) {
        const std::string rank_who = fmt::format("{}: rank {}", who, r);
        if (auto ok = use_device(devices[r], streams[r], rank_who); !ok) return undo(ok.error().message);
        auto s = alloc_scratch(n_ranks, streams[r], rank_who);
        if (!s) return undo(s.error().message);
        scratch[r] = *s;
    }
    auto id = NcclId::make();
    if (!id) return undo(fmt::format("{}: {}", who, id.error().message));

    // One group: NCCL initialises the ranks together (each alone would wait for the others).
    ncclConfig_t config = nonblocking_config();
    const ncclUniqueId uid = unique_id(*id);
    if (const ncclResult_t res = ncclGroupStart(); res != ncclSuccess) {
        return undo(fmt::format("{}: init: {}", who, nccl_text(res, nullptr)));
    }
    std::string failure;  // empty while every rank is well
    for (size_t r = 0; failure.empty() && r < n; ++r) {
        cudaSetDevice(devices[r]);
        const ncclResult_t res = ncclCommInitRankConfig(&comms[r], n_ranks, uid, static_cast<int>(r), &config);
        if (res != ncclSuccess && res != ncclInProgress) {
            failure = fmt::format("rank {} (GPU {}): {}", r, devices[r], nccl_text(res, comms[r]));
        }
    }
    if (const ncclResult_t end = ncclGroupEnd(); failure.empty() && end != ncclSuccess && end != ncclInProgress) {
        failure = nccl_text(end, nullptr);
    }
    const Clock::time_point deadline = Clock::now() + timeout;
    for (size_t r = 0; failure.empty() && r < n; ++r) {
        const ncclResult_t state = poll_state(comms[r], deadline);
        if (state == ncclInProgress) {
            failure = fmt::format("rank {} (GPU {}): not initialised after {} ms", r, devices[r], timeout.count());
        } else if (state != ncclSuccess) {
            failure = fmt::format("rank {} (GPU {}): {}", r, devices[r], nccl_text(state, comms[r]));
        }
    }
    if (!failure.empty()) return undo(fmt::format("{}: init: {}; aborted", who, failure));
    cudaSetDevice(caller_device);

    std::vector<std::unique_ptr<NcclCommunicator>> owned;
    owned.reserve(n);
    for (size_t r = 0; r < n; ++r) {
        owned.emplace_back(new NcclCommunicator(comms[r], scratch[r], n_ranks, static_cast<int>(r), devices[r],
                                                streams[r], timeout));
    }
    return NcclGroup(std::move(owned));
}

NcclCommunicator &NcclGroup::communicator(int rank) {
    MEMRA_CHECK(rank >= 0 && rank < size(), "nccl group: rank {} out of range for {} ranks", rank, size());
    return *comms_[static_cast<size_t>(rank)];
}

std::vector<std::unique_ptr<parallel::Communicator>> NcclGroup::release() {
    std::vector<std::unique_ptr<parallel::Communicator>> out;
    out.reserve(comms_.size());
    for (std::unique_ptr<NcclCommunicator> &c : comms_) out.push_back(std::move(c));
    comms_.clear();
    return out;
}

}  // namespace memra::cuda

#endif  // MEMRA_HAVE_NCCL
