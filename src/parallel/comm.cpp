// In-process communicator: N ranks as threads sharing one group state under one mutex. A collective is
// a rendezvous: each rank posts a descriptor (kind, source pointer, bytes, root); once all have arrived each
// rank checks all descriptors the same way (a mismatch fails every rank with one message), copies straight
// out of the other ranks' buffers, and then waits until every rank has finished copying, because only then
// may anyone reuse its buffers. Send/recv hand the sender's pointer to the receiver, who copies.
#include "parallel/comm.h"

#include <array>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "core/check.h"

namespace memra::parallel {
namespace {

enum class CollectiveKind : uint8_t { kAllGather, kBroadcast, kBarrier };

const char *kind_name(CollectiveKind kind) {
    switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
    }
    return "collective";
}

// What one rank brought to a collective.
struct CollectiveDesc {
    CollectiveKind kind = CollectiveKind::kBarrier;
    const std::byte *src = nullptr;  // all_gather: send; broadcast: buf (read by the others only on root)
    size_t bytes = 0;                // all_gather: per rank; broadcast: the buffer
    int root = 0;                    // broadcast only
};

enum class P2pState : uint8_t {
    kRecorded,  // inside an open group, not visible to the peer
    kPosted,    // a send the peer's recv may claim
    kCopying,   // the peer is copying out of it: the sender may not return
    kDone,
    kMismatch,  // met a recv of another size; both sides report it
};

struct P2pOp {
    bool is_send = false;
    int peer = 0;
    const std::byte *src = nullptr;  // send
    std::byte *dst = nullptr;        // recv
    size_t bytes = 0;
    P2pState state = P2pState::kRecorded;
    size_t recv_bytes = 0;  // kMismatch: the size of the recv it met
};

// What a rank is blocked on; the deadlock check reads these for every rank.
enum class WaitKind : uint8_t {
    kNone,       // running (not inside a blocking wait)
    kArrive,     // the other ranks to enter its collective
    kDepart,     // the other ranks to finish copying out of its buffers
    kRecv,       // a send from wait_peer to be posted
    kSends,      // its posted sends to be taken
    kCopiesOut,  // after an abort: peers still copying out of its sends
    kExited,     // returned from its run() function
};

struct RankState {
    std::condition_variable cv;  // this rank's waits; always with the group mutex
    // Descriptors of its collectives, double-buffered by parity: a rank that leaves collective k early
    // (barrier, failed check) writes k + 1's slot while slower ranks still read k's, and it cannot reach
    // k + 2 before all of them have entered k + 1.
    std::array<CollectiveDesc, 2> desc;
    int64_t n_collectives = 0;  // collectives entered
    int group_depth = 0;
    bool posting = false;     // ops are visible to peers (inside group_end); guarded by the mutex
    std::vector<P2pOp> ops;   // the open group, in call order; reshaped by the owner only when !posting
    WaitKind wait = WaitKind::kNone;
    int64_t wait_epoch = 0;   // kArrive / kDepart: the epoch at entry
    int wait_peer = 0;        // kRecv
    size_t wait_bytes = 0;    // kRecv
    bool saw_abort = false;   // an operation of this rank failed because the group was aborted
};

void host_copy(void *dst, const void *src, size_t n) { std::memcpy(dst, src, n); }

}  // namespace

struct InProcessGroup::State {
    class RankComm;

    State(int n_ranks, ByteCopy byte_copy);

    Result<void> collective(int me, const CollectiveDesc &desc, std::byte *dst);
    Result<void> check_collective(int slot, int64_t index) const;
    Result<void> run_group(int me, const char *op);
    Result<void> run_rank(int rank, RankFn fn);
    // Rank `rank`'s persistent thread: runs the function of each run() once, until stopping.
    void rank_thread(int rank);
    // Stops and joins the rank threads (the group destructor; create() when a thread fails to start).
    void stop_rank_threads();

    bool wait_for(std::unique_lock<std::mutex> &lock, int me, WaitKind kind, bool abortable);
    bool ready(int rank);
    bool check_deadlock();
    std::string describe_wait(int rank);
    P2pOp *find_posted(int src, int dst);
    void notify_others(int me);
    void abort_locked(const std::string &reason);
    tl::unexpected<Error> aborted_error(int me, const char *op);

    int n = 0;
    ByteCopy copy;  // how bytes move between ranks' buffers
    std::mutex mu;
    std::unique_ptr<RankState[]> ranks;  // [n]
    std::vector<RankComm> comms;         // [n]
    int arrived = 0;                     // ranks inside the current collective's arrival
    int64_t arrive_epoch = 0;            // collectives whose arrival completed
    int departed = 0;
    int64_t depart_epoch = 0;
    int n_stuck = 0;  // ranks waiting or exited: the deadlock check runs only when this reaches n
    bool aborted = false;
    std::string abort_reason;
    bool running = false;

    // run(): rank r's thread, started by create(), runs *run_fn once per generation.
    std::vector<std::thread> workers;
    std::condition_variable run_cv;   // rank threads wait here for the next generation or stopping
    std::condition_variable done_cv;  // run() waits here for run_pending to reach 0
    uint64_t run_generation = 0;
    int run_pending = 0;
    bool stopping = false;
    const RankFn *run_fn = nullptr;
    std::vector<Result<void>> results;  // [n]: each rank's result of the current run
};

class InProcessGroup::State::RankComm final : public Communicator {
public:
    RankComm(State *state, int rank) : state_(state), rank_(rank) {}

    int rank() const override { return rank_; }
    int size() const override { return state_->n; }

    Result<void> all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override {
        const size_t bytes = send.size();
        const size_t expected = static_cast<size_t>(state_->n) * bytes;
        if (in_group()) return make_error("all_gather: called inside a send/recv group (before group_end)");
        if (recv.size() != expected) {
            return make_error("all_gather: recv holds {} bytes, expected {} ranks x {} bytes = {}", recv.size(),
                              state_->n, bytes, expected);
        }
        if (bytes > 0) {
            const auto s = reinterpret_cast<uintptr_t>(send.data());
            const auto r = reinterpret_cast<uintptr_t>(recv.data());
            const std::byte *own_slot = recv.data() + static_cast<size_t>(rank_) * bytes;
            if (s < r + recv.size() && r < s + bytes && send.data() != own_slot) {
                return make_error("all_gather: send overlaps recv but is not this rank's slot (in place, rank {} "
                                  "passes recv bytes [{}, {}) as send)",
                                  rank_, static_cast<size_t>(rank_) * bytes, static_cast<size_t>(rank_ + 1) * bytes);
            }
        }
        return state_->collective(rank_, {CollectiveKind::kAllGather, send.data(), bytes, 0}, recv.data());
    }

    Result<void> broadcast(std::span<std::byte> buf, int root) override {
        if (in_group()) return make_error("broadcast: called inside a send/recv group (before group_end)");
        if (root < 0 || root >= state_->n) {
            return make_error("broadcast: root {} is out of range for a group of {} ranks", root, state_->n);
        }
        return state_->collective(rank_, {CollectiveKind::kBroadcast, buf.data(), buf.size(), root}, buf.data());
    }

    Result<void> barrier() override {
        if (in_group()) return make_error("barrier: called inside a send/recv group (before group_end)");
        return state_->collective(rank_, {CollectiveKind::kBarrier, nullptr, 0, 0}, nullptr);
    }

    Result<void> send(std::span<const std::byte> buf, int peer) override {
        if (auto ok = check_peer("send", peer); !ok) return ok;
        P2pOp op;
        op.is_send = true;
        op.peer = peer;
        op.src = buf.data();
        op.bytes = buf.size();
        return record(op, "send");
    }

    Result<void> recv(std::span<std::byte> buf, int peer) override {
        if (auto ok = check_peer("recv", peer); !ok) return ok;
        P2pOp op;
        op.peer = peer;
        op.dst = buf.data();
        op.bytes = buf.size();
        return record(op, "recv");
    }

    Result<void> group_start() override {
        ++state_->ranks[rank_].group_depth;
        return {};
    }

    Result<void> group_end() override {
        RankState &rs = state_->ranks[rank_];
        if (rs.group_depth == 0) return make_error("group_end: rank {} has no open group_start", rank_);
        if (--rs.group_depth > 0) return {};
        return state_->run_group(rank_, "group_end");
    }

private:
    bool in_group() const { return state_->ranks[rank_].group_depth > 0; }

    Result<void> check_peer(const char *op, int peer) const {
        if (peer < 0 || peer >= state_->n) {
            return make_error("{}: peer {} is out of range for a group of {} ranks", op, peer, state_->n);
        }
        if (peer == rank_) return make_error("{}: peer {} is this rank; a rank does not {} to itself", op, peer, op);
        return {};
    }

    // The owner appends without the mutex: peers look at ops only while posting, which is false here.
    Result<void> record(const P2pOp &op, const char *name) {
        RankState &rs = state_->ranks[rank_];
        rs.ops.push_back(op);
        if (rs.group_depth > 0) return {};
        return state_->run_group(rank_, name);
    }

    State *state_;
    int rank_;
};

InProcessGroup::State::State(int n_ranks, ByteCopy byte_copy)
    : n(n_ranks), copy(byte_copy != nullptr ? byte_copy : host_copy), ranks(std::make_unique<RankState[]>(n_ranks)) {
    // A full exchange with every peer is one send and one recv per peer.
    for (int r = 0; r < n; ++r) ranks[r].ops.reserve(2 * static_cast<size_t>(n));
    comms.reserve(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) comms.emplace_back(this, r);
    workers.reserve(static_cast<size_t>(n));
    results.resize(static_cast<size_t>(n));
}

void InProcessGroup::State::notify_others(int me) {
    for (int r = 0; r < n; ++r) {
        if (r != me) ranks[r].cv.notify_one();
    }
}

void InProcessGroup::State::abort_locked(const std::string &reason) {
    if (aborted) return;  // the first reason is the cause; later ones are its consequences
    aborted = true;
    abort_reason = reason;
    for (int r = 0; r < n; ++r) ranks[r].cv.notify_all();
}

tl::unexpected<Error> InProcessGroup::State::aborted_error(int me, const char *op) {
    ranks[me].saw_abort = true;
    return make_error("{}: group aborted: {}", op, abort_reason);
}

// The first send from src to dst not yet taken, if src has posted it. Only dst claims these, one at a
// time and in order, so the FIFO head is the first kPosted entry.
P2pOp *InProcessGroup::State::find_posted(int src, int dst) {
    RankState &s = ranks[src];
    if (!s.posting) return nullptr;
    for (P2pOp &op : s.ops) {
        if (op.is_send && op.peer == dst && op.state == P2pState::kPosted) return &op;
    }
    return nullptr;
}

// Whether rank's current wait is satisfied. Every such condition, once true, stays true until that rank
// acts on it, which is what makes "all ranks stuck and none ready" a real deadlock.
bool InProcessGroup::State::ready(int rank) {
    RankState &rs = ranks[rank];
    switch (rs.wait) {
    case WaitKind::kArrive: return arrive_epoch != rs.wait_epoch;
    case WaitKind::kDepart: return depart_epoch != rs.wait_epoch;
    case WaitKind::kRecv: return find_posted(rs.wait_peer, rank) != nullptr;
    case WaitKind::kSends:
        for (const P2pOp &op : rs.ops) {
            if (op.is_send && op.state != P2pState::kDone && op.state != P2pState::kMismatch) return false;
        }
        return true;
    case WaitKind::kCopiesOut:
        for (const P2pOp &op : rs.ops) {
            if (op.state == P2pState::kCopying) return false;
        }
        return true;
    case WaitKind::kNone:
    case WaitKind::kExited: return false;
    }
    return false;
}

std::string InProcessGroup::State::describe_wait(int rank) {
    const RankState &rs = ranks[rank];
    switch (rs.wait) {
    case WaitKind::kArrive: {
        const int64_t k = rs.n_collectives - 1;
        return fmt::format("rank {} waits in {} (collective {})", rank, kind_name(rs.desc[k & 1].kind), k);
    }
    case WaitKind::kDepart: return fmt::format("rank {} waits for the others to finish copying", rank);
    case WaitKind::kRecv:
        return fmt::format("rank {} waits to recv {} bytes from rank {}", rank, rs.wait_bytes, rs.wait_peer);
    case WaitKind::kSends:
        for (const P2pOp &op : rs.ops) {
            if (op.is_send && op.state == P2pState::kPosted) {
                return fmt::format("rank {} waits for rank {} to recv its send of {} bytes", rank, op.peer, op.bytes);
            }
        }
        return fmt::format("rank {} waits for its sends to be taken", rank);
    case WaitKind::kCopiesOut: return fmt::format("rank {} waits for copies out of its sends", rank);
    case WaitKind::kExited: return fmt::format("rank {} has returned from its rank function", rank);
    case WaitKind::kNone: break;
    }
    return fmt::format("rank {} is running", rank);
}

// Called with the mutex held when every rank is waiting or exited. Aborts the group and returns true if
// none of the waiting ranks can proceed.
bool InProcessGroup::State::check_deadlock() {
    bool any_waiting = false;
    for (int r = 0; r < n; ++r) {
        const WaitKind w = ranks[r].wait;
        if (w == WaitKind::kNone) return false;
        if (w == WaitKind::kExited) continue;
        if (ready(r)) return false;
        any_waiting = true;
    }
    if (!any_waiting) return false;  // all returned: a finished run
    std::string reason = "deadlock:";
    for (int r = 0; r < n; ++r) reason += (r == 0 ? " " : "; ") + describe_wait(r);
    abort_locked(reason);
    return true;
}

// Blocks rank `me` until its wait of `kind` is satisfied. Returns false if the group was aborted first;
// a non-abortable wait (others are copying out of this rank's buffers) always runs to completion, which
// is bounded because copying never blocks.
bool InProcessGroup::State::wait_for(std::unique_lock<std::mutex> &lock, int me, WaitKind kind, bool abortable) {
    RankState &rs = ranks[me];
    rs.wait = kind;
    ++n_stuck;
    bool ok = true;
    for (;;) {
        if (ready(me)) break;
        if (abortable && aborted) {
            ok = false;
            break;
        }
        if (!aborted && n_stuck == n && check_deadlock()) continue;
        rs.cv.wait(lock);
    }
    rs.wait = WaitKind::kNone;
    --n_stuck;
    return ok;
}

Result<void> InProcessGroup::State::check_collective(int slot, int64_t index) const {
    const CollectiveDesc &d0 = ranks[0].desc[slot];
    for (int r = 1; r < n; ++r) {
        const CollectiveDesc &d = ranks[r].desc[slot];
        if (d.kind != d0.kind) {
            return make_error("collective {}: rank {} called {}, rank 0 called {}", index, r, kind_name(d.kind),
                              kind_name(d0.kind));
        }
    }
    if (d0.kind == CollectiveKind::kBarrier) return {};
    const char *name = kind_name(d0.kind);
    for (int r = 1; r < n; ++r) {
        const CollectiveDesc &d = ranks[r].desc[slot];
        if (d0.kind == CollectiveKind::kBroadcast && d.root != d0.root) {
            return make_error("broadcast (collective {}): rank {} named root {}, rank 0 named root {}", index, r,
                              d.root, d0.root);
        }
    }
    for (int r = 1; r < n; ++r) {
        const CollectiveDesc &d = ranks[r].desc[slot];
        if (d.bytes != d0.bytes) {
            return make_error("{} (collective {}): rank {} {} {} bytes, rank 0 {} {}", name, index, r,
                              d0.kind == CollectiveKind::kAllGather ? "sent" : "passed", d.bytes,
                              d0.kind == CollectiveKind::kAllGather ? "sent" : "passed", d0.bytes);
        }
    }
    return {};
}

Result<void> InProcessGroup::State::collective(int me, const CollectiveDesc &desc, std::byte *dst) {
    RankState &rs = ranks[me];
    const char *name = kind_name(desc.kind);
    std::unique_lock<std::mutex> lock(mu);
    if (aborted) return aborted_error(me, name);
    const int64_t index = rs.n_collectives++;
    const int slot = static_cast<int>(index & 1);
    rs.desc[slot] = desc;
    rs.wait_epoch = arrive_epoch;
    if (++arrived == n) {
        arrived = 0;
        ++arrive_epoch;
        // Woken ranks need the mutex at once: release it first. A late notify is at worst a spurious
        // wakeup of the rank's next wait, and the condition variables live as long as the group.
        lock.unlock();
        notify_others(me);
    } else if (!wait_for(lock, me, WaitKind::kArrive, true)) {
        return aborted_error(me, name);
    } else {
        lock.unlock();
    }

    // Every rank sees the same descriptors, so every rank reaches the same verdict and, on a mismatch,
    // none of them copies or waits below.
    if (auto checked = check_collective(slot, index); !checked) return checked;
    if (desc.kind == CollectiveKind::kBarrier) return {};
    if (desc.kind == CollectiveKind::kAllGather) {
        for (int r = 0; r < n; ++r) {
            const CollectiveDesc &d = ranks[r].desc[slot];
            std::byte *out = dst + static_cast<size_t>(r) * d.bytes;
            if (d.bytes > 0 && d.src != out) copy(out, d.src, d.bytes);
        }
    } else if (me != desc.root && desc.bytes > 0) {
        copy(dst, ranks[desc.root].desc[slot].src, desc.bytes);
    }

    lock.lock();
    rs.wait_epoch = depart_epoch;
    if (++departed == n) {
        departed = 0;
        ++depart_epoch;
        lock.unlock();
        notify_others(me);
    } else {
        wait_for(lock, me, WaitKind::kDepart, false);
    }
    return {};
}

namespace {

// The same text on the sending and the receiving rank.
tl::unexpected<Error> p2p_mismatch(int src, int dst, size_t send_bytes, size_t recv_bytes) {
    return make_error("send/recv: rank {} sent {} bytes to rank {}, whose matching recv takes {} bytes", src,
                      send_bytes, dst, recv_bytes);
}

}  // namespace

Result<void> InProcessGroup::State::run_group(int me, const char *op) {
    RankState &rs = ranks[me];
    std::unique_lock<std::mutex> lock(mu);
    if (aborted) {
        rs.ops.clear();
        return aborted_error(me, op);
    }
    for (P2pOp &o : rs.ops) {
        if (o.is_send) o.state = P2pState::kPosted;
    }
    rs.posting = true;
    for (const P2pOp &o : rs.ops) {
        if (o.is_send) ranks[o.peer].cv.notify_one();
    }

    Result<void> result;
    bool released = false;  // aborted while inside the group
    for (P2pOp &o : rs.ops) {
        if (o.is_send) continue;
        rs.wait_peer = o.peer;
        rs.wait_bytes = o.bytes;
        if (!wait_for(lock, me, WaitKind::kRecv, true)) {
            released = true;
            break;
        }
        P2pOp *match = find_posted(o.peer, me);
        if (match->bytes != o.bytes) {
            match->state = P2pState::kMismatch;
            match->recv_bytes = o.bytes;
            ranks[o.peer].cv.notify_one();
            if (result) result = p2p_mismatch(o.peer, me, match->bytes, o.bytes);
            continue;
        }
        // The sender cannot return while its entry is kCopying, so its buffer outlives the copy.
        match->state = P2pState::kCopying;
        lock.unlock();
        if (o.bytes > 0) copy(o.dst, match->src, o.bytes);
        lock.lock();
        match->state = P2pState::kDone;
        ranks[o.peer].cv.notify_one();
    }
    if (!released && !wait_for(lock, me, WaitKind::kSends, true)) released = true;
    if (released) {
        wait_for(lock, me, WaitKind::kCopiesOut, false);
        if (result) result = aborted_error(me, op);
    }
    for (const P2pOp &o : rs.ops) {
        if (result && o.is_send && o.state == P2pState::kMismatch) {
            result = p2p_mismatch(me, o.peer, o.bytes, o.recv_bytes);
        }
    }
    rs.posting = false;
    lock.unlock();
    rs.ops.clear();
    return result;
}

Result<void> InProcessGroup::State::run_rank(int rank, RankFn fn) {
    Result<void> result;
    try {
        result = fn(rank, comms[static_cast<size_t>(rank)]);
    } catch (const std::exception &e) {
        result = make_error("threw an exception: {}", e.what());
    } catch (...) {
        result = make_error("threw an exception that is not a std::exception");
    }
    std::lock_guard<std::mutex> lock(mu);
    if (result) {
        // Ranks still waiting on this one can now only be released by the deadlock check.
        ranks[rank].wait = WaitKind::kExited;
        ++n_stuck;
        if (!aborted && n_stuck == n) check_deadlock();
    } else {
        abort_locked(fmt::format("rank {}: {}", rank, result.error().message));
    }
    return result;
}

void InProcessGroup::State::rank_thread(int rank) {
    uint64_t seen = 0;  // the generation it last ran
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
        run_cv.wait(lock, [&] { return stopping || run_generation != seen; });
        if (stopping) return;
        seen = run_generation;
        const RankFn fn = *run_fn;
        lock.unlock();
        Result<void> result = run_rank(rank, fn);
        lock.lock();
        results[static_cast<size_t>(rank)] = std::move(result);
        if (--run_pending == 0) done_cv.notify_one();
    }
}

void InProcessGroup::State::stop_rank_threads() {
    {
        std::lock_guard<std::mutex> lock(mu);
        stopping = true;
    }
    run_cv.notify_all();
    for (std::thread &t : workers) t.join();
    workers.clear();
}

// ---- InProcessGroup ----------------------------------------------------------------------------------

InProcessGroup::InProcessGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}
InProcessGroup::InProcessGroup(InProcessGroup &&) noexcept = default;
InProcessGroup &InProcessGroup::operator=(InProcessGroup &&other) noexcept {
    if (this != &other) {
        if (state_) state_->stop_rank_threads();  // the threads refer to the state about to go
        state_ = std::move(other.state_);
    }
    return *this;
}
InProcessGroup::~InProcessGroup() {
    if (state_) state_->stop_rank_threads();  // else moved from
}

Result<InProcessGroup> InProcessGroup::create(int n_ranks, ByteCopy copy) {
    if (n_ranks < 1 || n_ranks > kMaxRanks) {
        return make_error("in-process group: expected 1 to {} ranks, found {}", kMaxRanks, n_ranks);
    }
    auto state = std::make_unique<State>(n_ranks, copy);
    for (int r = 0; r < n_ranks; ++r) {
        try {
            state->workers.emplace_back([s = state.get(), r] { s->rank_thread(r); });
        } catch (const std::system_error &e) {
            state->stop_rank_threads();
            return make_error("in-process group: could not start the thread of rank {} of {}: {}", r, n_ranks,
                              e.what());
        }
    }
    return InProcessGroup(std::move(state));
}

int InProcessGroup::size() const { return state_->n; }

Communicator &InProcessGroup::communicator(int rank) {
    MEMRA_CHECK(rank >= 0 && rank < state_->n, "in-process group: rank {} out of range for {} ranks", rank,
                state_->n);
    return state_->comms[static_cast<size_t>(rank)];
}

void InProcessGroup::abort(const std::string &reason) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->abort_locked(reason);
}

bool InProcessGroup::aborted() const {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->aborted;
}

Result<void> InProcessGroup::run(RankFn fn) {
    State &s = *state_;
    {
        std::lock_guard<std::mutex> lock(s.mu);
        MEMRA_CHECK(!s.running, "in-process group: run() called while the group is already running");
        s.running = true;
        for (int r = 0; r < s.n; ++r) s.ranks[r].saw_abort = false;
    }
    {
        std::unique_lock<std::mutex> lock(s.mu);
        for (Result<void> &r : s.results) r = {};
        s.run_fn = &fn;
        s.run_pending = s.n;
        ++s.run_generation;
        s.run_cv.notify_all();
        s.done_cv.wait(lock, [&] { return s.run_pending == 0; });
        s.run_fn = nullptr;
    }
    const std::vector<Result<void>> &results = s.results;

    {
        std::lock_guard<std::mutex> lock(s.mu);
        s.running = false;
        for (int r = 0; r < s.n; ++r) {
            RankState &rs = s.ranks[r];
            if (rs.wait == WaitKind::kExited) {
                rs.wait = WaitKind::kNone;
                --s.n_stuck;
            }
            rs.group_depth = 0;  // a rank that returned inside a group leaves nothing behind
            rs.ops.clear();
        }
    }
    int first = -1;      // first failure by rank order
    int own_first = -1;  // first failure that was not just the abort reaching that rank
    for (int r = 0; r < s.n; ++r) {
        if (results[static_cast<size_t>(r)]) continue;
        if (first < 0) first = r;
        if (own_first < 0 && !s.ranks[r].saw_abort) own_first = r;
    }
    if (first < 0) return {};
    const int pick = own_first >= 0 ? own_first : first;
    return wrap_error(fmt::format("rank {}", pick), results[static_cast<size_t>(pick)].error());
}

Result<void> run_ranks(int n_ranks, RankFn fn) {
    auto group = InProcessGroup::create(n_ranks);
    if (!group) return tl::unexpected(group.error());
    return group->run(fn);
}

}  // namespace memra::parallel
