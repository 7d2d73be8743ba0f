// MPI world helpers and MpiCommunicator (mpi_comm.h): InProcessGroup's argument checks, then one MPI call
// per operation on bytes (MPI_BYTE). Sends and recvs use one tag, so MPI's non-overtaking rule gives comm.h's
// FIFO per ordered pair. A group's recvs are posted before its sends (MPI_Irecv, MPI_Isend), then each is
// waited for (MPI_Wait, in call order) and every recv's count is checked against its buffer.
#include "parallel/mpi_comm.h"

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace memra::parallel {
namespace {

// MPI counts are ints.
constexpr size_t kMaxCount = INT_MAX;
// The tag of every send and recv of a communicator.
constexpr int kTag = 0;

// The process-wide state of mpi_init() / mpi_finalize().
struct Process {
    std::mutex mu;
    bool ready = false;    // mpi_init() succeeded and mpi_finalize() has not run
    bool started = false;  // mpi_init() called MPI_Init_thread: finalizing is ours
    bool finalized = false;
    MpiWorld world;
    MPI_Comm helpers = MPI_COMM_NULL;  // mpi_broadcast's duplicate of the world
};

Process &process() {
    static Process p;
    return p;
}

// MPI's text for an error code ("MPI_ERR_TRUNCATE: message truncated").
std::string mpi_reason(int code) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return fmt::format("MPI error code {}", code);
    return std::string(text, static_cast<size_t>(length));
}

bool is_truncation(int code) {
    int error_class = MPI_SUCCESS;
    return MPI_Error_class(code, &error_class) == MPI_SUCCESS && error_class == MPI_ERR_TRUNCATE;
}

const char *thread_level_name(int level) {
    if (level == MPI_THREAD_SINGLE) return "MPI_THREAD_SINGLE";
    if (level == MPI_THREAD_FUNNELED) return "MPI_THREAD_FUNNELED";
    if (level == MPI_THREAD_SERIALIZED) return "MPI_THREAD_SERIALIZED";
    if (level == MPI_THREAD_MULTIPLE) return "MPI_THREAD_MULTIPLE";
    return "an unknown level";
}

tl::unexpected<Error> too_many_bytes(const char *op, size_t bytes) {
    return make_error("{}: {} bytes exceed MPI's count limit of {} bytes (INT_MAX) per operation", op, bytes,
                      kMaxCount);
}

// The same text as InProcessGroup's, from the receiving rank.
tl::unexpected<Error> p2p_mismatch(int src, int dst, size_t send_bytes, size_t recv_bytes) {
    return make_error("send/recv: rank {} sent {} bytes to rank {}, whose matching recv takes {} bytes", src,
                      send_bytes, dst, recv_bytes);
}

// The world's rank and size and this host's share of it, asked of `world`.
Result<MpiWorld> query_world(MPI_Comm world) {
    MpiWorld w;
    int rc = MPI_Comm_rank(world, &w.rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(world, &w.size);
    if (rc != MPI_SUCCESS) return make_error("mpi init: the world's rank and size: {}", mpi_reason(rc));
    MPI_Comm local = MPI_COMM_NULL;
    rc = MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, w.rank, MPI_INFO_NULL, &local);
    if (rc != MPI_SUCCESS) return make_error("mpi init: splitting the world by host: {}", mpi_reason(rc));
    rc = MPI_Comm_rank(local, &w.local_rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(local, &w.local_size);
    MPI_Comm_free(&local);
    if (rc != MPI_SUCCESS) return make_error("mpi init: the rank and size on this host: {}", mpi_reason(rc));
    return w;
}

// A duplicate of the world whose failures are returned, not fatal.
Result<MPI_Comm> duplicate_world(const char *who) {
    MPI_Comm comm = MPI_COMM_NULL;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    if (rc != MPI_SUCCESS) return make_error("{}: duplicating the world communicator: {}", who, mpi_reason(rc));
    rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
        MPI_Comm_free(&comm);
        return make_error("{}: setting MPI_ERRORS_RETURN: {}", who, mpi_reason(rc));
    }
    return comm;
}

bool mpi_running() {
    int initialized = 0;
    int finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    return initialized != 0 && finalized == 0;
}

}  // namespace

Result<MpiWorld> mpi_init() {
    Process &p = process();
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.ready) return p.world;
    if (p.finalized) return make_error("mpi init: MPI was finalized in this process and cannot start again");
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (initialized == 0) {
        if (const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided); rc != MPI_SUCCESS) {
            return make_error("mpi init: MPI_Init_thread: {}", mpi_reason(rc));
        }
        p.started = true;
    } else if (const int rc = MPI_Query_thread(&provided); rc != MPI_SUCCESS) {
        // Started by someone else, who also finalizes it.
        return make_error("mpi init: MPI_Query_thread: {}", mpi_reason(rc));
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        if (p.started) {
            MPI_Finalize();
            p.started = false;
            p.finalized = true;
        }
        return make_error("mpi init: expected thread support MPI_THREAD_SERIALIZED, the MPI library provides {}",
                          thread_level_name(provided));
    }
    if (const int rc = MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN); rc != MPI_SUCCESS) {
        return make_error("mpi init: setting MPI_ERRORS_RETURN on the world: {}", mpi_reason(rc));
    }
    auto world = query_world(MPI_COMM_WORLD);
    if (!world) return world;
    auto helpers = duplicate_world("mpi init");
    if (!helpers) return tl::unexpected(helpers.error());
    p.helpers = *helpers;
    p.world = *world;
    p.ready = true;
    return p.world;
}

void mpi_finalize() {
    Process &p = process();
    std::lock_guard<std::mutex> lock(p.mu);
    p.ready = false;
    if (p.helpers != MPI_COMM_NULL && mpi_running()) MPI_Comm_free(&p.helpers);
    p.helpers = MPI_COMM_NULL;
    if (p.started && !p.finalized) {
        MPI_Finalize();
        p.finalized = true;
    }
}

void mpi_abort(int code) {
    std::fflush(nullptr);  // what this process printed last is usually why it aborts
    if (mpi_running()) MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; without MPI this is the whole job
}

Result<void> mpi_broadcast(std::span<std::byte> buf, int root) {
    Process &p = process();
    MPI_Comm comm = MPI_COMM_NULL;
    int n = 0;
    {
        std::lock_guard<std::mutex> lock(p.mu);
        if (!p.ready) return make_error("mpi_broadcast: MPI is not initialised (mpi_init first)");
        comm = p.helpers;
        n = p.world.size;
    }
    if (root < 0 || root >= n) {
        return make_error("mpi_broadcast: root {} is out of range for a world of {} processes", root, n);
    }
    if (buf.size() > kMaxCount) return too_many_bytes("mpi_broadcast", buf.size());
    if (const int rc = MPI_Bcast(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, root, comm); rc != MPI_SUCCESS) {
        return make_error("mpi_broadcast of {} bytes from root {}: {}", buf.size(), root, mpi_reason(rc));
    }
    return {};
}

// ---- MpiCommunicator ---------------------------------------------------------------------------------

struct MpiCommunicator::State {
    // A send or recv recorded inside a group.
    struct Op {
        bool is_send = false;
        int peer = 0;
        const std::byte *src = nullptr;  // send
        std::byte *dst = nullptr;        // recv
        size_t bytes = 0;
        int post_rc = MPI_SUCCESS;  // what MPI_Isend / MPI_Irecv returned
    };

    State() = default;
    State(const State &) = delete;
    State &operator=(const State &) = delete;
    ~State() {
        if (comm != MPI_COMM_NULL && mpi_running()) MPI_Comm_free(&comm);
    }

    // "<what> (rank r of n): <MPI's reason>"
    template <class... Args>
    tl::unexpected<Error> failure(int rc, fmt::format_string<Args...> what, Args &&...args) const {
        return make_error("{} (rank {} of {}): {}", fmt::format(what, std::forward<Args>(args)...), rank, n,
                          mpi_reason(rc));
    }

    tl::unexpected<Error> in_group(const char *op) const {
        return make_error("{}: called inside a send/recv group (before group_end)", op);
    }

    Result<void> check_p2p(const char *op, size_t bytes, int peer) const {
        if (peer < 0 || peer >= n) {
            return make_error("{}: peer {} is out of range for a communicator of {} ranks", op, peer, n);
        }
        if (peer == rank) {
            return make_error("{}: peer {} is this rank; a rank does not send to or receive from itself", op, peer);
        }
        if (bytes > kMaxCount) return too_many_bytes(op, bytes);
        return {};
    }

    // The end of a recv of `bytes` from `peer`: MPI's code for it (rc) and its status. An Error unless
    // exactly `bytes` arrived.
    Result<void> check_recv(int rc, const MPI_Status &status, size_t bytes, int peer) const {
        int count = MPI_UNDEFINED;
        const bool truncated = is_truncation(rc);
        if (rc != MPI_SUCCESS && !truncated) return failure(rc, "recv of {} bytes from rank {}", bytes, peer);
        const bool counted = MPI_Get_count(&status, MPI_BYTE, &count) == MPI_SUCCESS && count != MPI_UNDEFINED;
        if (truncated) {
            // Open MPI counts the whole message even when it did not fit.
            if (counted && static_cast<size_t>(count) > bytes) {
                return p2p_mismatch(peer, rank, static_cast<size_t>(count), bytes);
            }
            return make_error("send/recv: rank {} sent more than the {} bytes that rank {}'s matching recv takes "
                              "({})",
                              peer, bytes, rank, mpi_reason(rc));
        }
        if (!counted) return make_error("recv of {} bytes from rank {}: MPI gave no byte count", bytes, peer);
        if (static_cast<size_t>(count) != bytes) return p2p_mismatch(peer, rank, static_cast<size_t>(count), bytes);
        return {};
    }

    Result<void> run_group();

    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0;
    int n = 1;
    int group_depth = 0;
    std::vector<Op> ops;  // the open group, in call order
    // [ops.capacity()] once a group has run: requests[i] belongs to ops[i].
    std::vector<MPI_Request> requests;
};

// Posts the group's recvs, then its sends, waits for all of them and reports the first failure in call order.
// Every posted operation is complete (or failed) when it returns, so no buffer is still in MPI's hands.
Result<void> MpiCommunicator::State::run_group() {
    const size_t n_ops = ops.size();
    if (n_ops == 0) return {};
    if (requests.size() < n_ops) {  // a group larger than any before: the one-time growth
        requests.resize(ops.capacity());
    }
    for (int pass = 0; pass < 2; ++pass) {
        const bool sends = pass == 1;
        for (size_t i = 0; i < n_ops; ++i) {
            Op &op = ops[i];
            if (op.is_send != sends) continue;
            const int count = static_cast<int>(op.bytes);
            op.post_rc = sends ? MPI_Isend(op.src, count, MPI_BYTE, op.peer, kTag, comm, &requests[i])
                               : MPI_Irecv(op.dst, count, MPI_BYTE, op.peer, kTag, comm, &requests[i]);
            if (op.post_rc != MPI_SUCCESS) requests[i] = MPI_REQUEST_NULL;
        }
    }
    // One MPI_Wait per operation rather than one MPI_Waitall: Open MPI 4.1's MPI_Waitall can spin forever
    // once one of its requests has failed (a truncated recv beside other requests), and each wait gives
    // its operation its own error code.
    Result<void> result;
    for (size_t i = 0; i < n_ops; ++i) {
        const Op &op = ops[i];
        MPI_Status status{};
        const int rc = op.post_rc == MPI_SUCCESS ? MPI_Wait(&requests[i], &status) : op.post_rc;
        Result<void> done;
        if (op.is_send) {
            if (rc != MPI_SUCCESS) done = failure(rc, "send of {} bytes to rank {}", op.bytes, op.peer);
        } else {
            done = check_recv(rc, status, op.bytes, op.peer);
        }
        if (result && !done) result = std::move(done);
    }
    ops.clear();
    return result;
}

MpiCommunicator::MpiCommunicator(std::unique_ptr<State> state) : state_(std::move(state)) {}
MpiCommunicator::~MpiCommunicator() = default;

Result<std::unique_ptr<MpiCommunicator>> MpiCommunicator::create() {
    {
        Process &p = process();
        std::lock_guard<std::mutex> lock(p.mu);
        if (!p.ready) return make_error("mpi communicator: MPI is not initialised (mpi_init first)");
    }
    auto state = std::make_unique<State>();
    auto comm = duplicate_world("mpi communicator");
    if (!comm) return tl::unexpected(comm.error());
    state->comm = *comm;
    int rc = MPI_Comm_rank(state->comm, &state->rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(state->comm, &state->n);
    if (rc != MPI_SUCCESS) return make_error("mpi communicator: its rank and size: {}", mpi_reason(rc));
    // A full exchange with every peer is one send and one recv per peer.
    const size_t room = 2 * static_cast<size_t>(state->n);
    state->ops.reserve(room);
    state->requests.resize(room, MPI_REQUEST_NULL);
    return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(state)));
}

int MpiCommunicator::rank() const { return state_->rank; }
int MpiCommunicator::size() const { return state_->n; }

Result<void> MpiCommunicator::all_gather(std::span<const std::byte> send, std::span<std::byte> recv) {
    const State &s = *state_;
    const size_t bytes = send.size();
    const size_t expected = static_cast<size_t>(s.n) * bytes;
    if (s.group_depth > 0) return s.in_group("all_gather");
    if (recv.size() != expected) {
        return make_error("all_gather: recv holds {} bytes, expected {} ranks x {} bytes = {}", recv.size(), s.n,
                          bytes, expected);
    }
    const std::byte *own_slot = recv.data() + static_cast<size_t>(s.rank) * bytes;
    if (bytes > 0) {
        const auto sp = reinterpret_cast<uintptr_t>(send.data());
        const auto rp = reinterpret_cast<uintptr_t>(recv.data());
        if (sp < rp + recv.size() && rp < sp + bytes && send.data() != own_slot) {
            return make_error("all_gather: send overlaps recv but is not this rank's slot (in place, rank {} "
                              "passes recv bytes [{}, {}) as send)",
                              s.rank, static_cast<size_t>(s.rank) * bytes, static_cast<size_t>(s.rank + 1) * bytes);
        }
    }
    if (bytes > kMaxCount) return too_many_bytes("all_gather", bytes);
    const int count = static_cast<int>(bytes);
    const void *src = bytes > 0 && send.data() == own_slot ? MPI_IN_PLACE : send.data();
    if (const int rc = MPI_Allgather(src, count, MPI_BYTE, recv.data(), count, MPI_BYTE, s.comm); rc != MPI_SUCCESS) {
        return s.failure(rc, "all_gather of {} bytes", bytes);
    }
    return {};
}

Result<void> MpiCommunicator::broadcast(std::span<std::byte> buf, int root) {
    const State &s = *state_;
    if (s.group_depth > 0) return s.in_group("broadcast");
    if (root < 0 || root >= s.n) {
        return make_error("broadcast: root {} is out of range for a communicator of {} ranks", root, s.n);
    }
    if (buf.size() > kMaxCount) return too_many_bytes("broadcast", buf.size());
    if (const int rc = MPI_Bcast(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, root, s.comm); rc != MPI_SUCCESS) {
        return s.failure(rc, "broadcast of {} bytes from root {}", buf.size(), root);
    }
    return {};
}

Result<void> MpiCommunicator::barrier() {
    const State &s = *state_;
    if (s.group_depth > 0) return s.in_group("barrier");
    if (const int rc = MPI_Barrier(s.comm); rc != MPI_SUCCESS) return s.failure(rc, "barrier");
    return {};
}

Result<void> MpiCommunicator::send(std::span<const std::byte> buf, int peer) {
    State &s = *state_;
    if (auto ok = s.check_p2p("send", buf.size(), peer); !ok) return ok;
    if (s.group_depth > 0) {
        s.ops.push_back({true, peer, buf.data(), nullptr, buf.size()});
        return {};
    }
    // Synchronous: returns once the peer's recv has matched it, as comm.h asks.
    const int rc = MPI_Ssend(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, peer, kTag, s.comm);
    if (rc != MPI_SUCCESS) return s.failure(rc, "send of {} bytes to rank {}", buf.size(), peer);
    return {};
}

Result<void> MpiCommunicator::recv(std::span<std::byte> buf, int peer) {
    State &s = *state_;
    if (auto ok = s.check_p2p("recv", buf.size(), peer); !ok) return ok;
    if (s.group_depth > 0) {
        s.ops.push_back({false, peer, nullptr, buf.data(), buf.size()});
        return {};
    }
    MPI_Status status{};
    const int rc = MPI_Recv(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, peer, kTag, s.comm, &status);
    return s.check_recv(rc, status, buf.size(), peer);
}

Result<void> MpiCommunicator::group_start() {
    ++state_->group_depth;
    return {};
}

Result<void> MpiCommunicator::group_end() {
    State &s = *state_;
    if (s.group_depth == 0) return make_error("group_end: rank {} has no open group_start", s.rank);
    if (--s.group_depth > 0) return {};
    return s.run_group();
}

}  // namespace memra::parallel
