// Ranks as separate processes started by an MPI launcher (Open MPI's mpirun): where this process stands in
// the job (MpiWorld), the few world-wide calls a multi-process launch needs (init, finalize, abort, a
// broadcast to hand out an NCCL id), and MpiCommunicator, parallel::Communicator across the processes for
// CPU ranks (host memory). mpi.h stays out of this header.
//
// Only launched_by_mpi() exists in every build; the rest is compiled when CMake finds MPI (target
// memra_mpi, which makes MEMRA_HAVE_MPI visible to whatever links it).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <span>

#include "core/result.h"
#include "parallel/comm.h"

namespace memra::parallel {

// Whether an MPI launcher started this process: Open MPI's mpirun sets OMPI_COMM_WORLD_SIZE, PMIx launchers
// (Open MPI 5, Slurm's srun --mpi=pmix) PMIX_RANK, PMI launchers (MPICH's hydra, srun --mpi=pmi2) PMI_RANK.
// Reads the environment only: it needs no MPI library and is true before mpi_init().
inline bool launched_by_mpi() {
    return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
           std::getenv("PMI_RANK") != nullptr;
}

#ifdef MEMRA_HAVE_MPI

// This process's place in the job; local_* count the processes on this host.
struct MpiWorld {
    int rank = 0;
    int size = 1;
    int local_rank = 0;
    int local_size = 1;
};

// Initialises MPI once per process (MPI_Init_thread asking for MPI_THREAD_SERIALIZED: MPI may be called from
// any thread, one at a time) and returns the world; later calls return the same world. MPI failures become
// Errors (MPI_ERRORS_RETURN), not aborts. Refused when the library offers less than serialized threading,
// and after mpi_finalize() (MPI cannot start twice in one process). Under a launcher every process calls it.
Result<MpiWorld> mpi_init();
// Finalizes MPI if mpi_init() started it; a no-op otherwise and on a second call. Every MpiCommunicator is
// destroyed first. Collective: every process calls it.
void mpi_finalize();
// Ends the whole job with `code` (MPI_Abort on the world), so the launcher stops every process instead of
// leaving the others waiting in a collective. Without MPI running, exits this process with `code`.
[[noreturn]] void mpi_abort(int code);
// Every process's buf receives root's buf (the NCCL id from rank 0, say). Collective over the world with its
// own communicator, apart from every MpiCommunicator's traffic; all processes pass the same root and size.
// root in [0, world size), at most INT_MAX bytes.
Result<void> mpi_broadcast(std::span<std::byte> buf, int root);

// One rank per process: rank() is the world rank, size() the world size, over the communicator's own
// duplicate of the world. Host memory only. The semantics are comm.h's with two limits of MPI:
//   - a send whose recv has another size fails on the receiving rank only (MPI does not tell the sender);
//   - ranks that disagree in a collective (its kind, size or root) are not detected: MPI's behaviour is
//     undefined then (a hang or a failure).
// Argument checks are InProcessGroup's (a rank never sends to or receives from itself); a refused call
// makes no MPI call, so it takes no part. Operations of more than INT_MAX bytes (MPI's count) are refused.
// Zero-byte sends and recvs are messages like any other: they match and keep the FIFO order.
//
// An MPI failure is an Error naming the operation and MPI's reason. A size mismatch leaves the ranks in
// step; any other MPI failure may not, so the caller ends the job (mpi_abort).
//
// Nothing is allocated by the operations (the Error of a failure aside): create() reserves room for a group
// of 2 * size() sends and recvs, and a larger group grows that room once.
//
// One thread at a time per communicator; mpi_init() first, destroyed before mpi_finalize().
class MpiCommunicator final : public Communicator {
public:
    // Collective over the world: every process calls it (in the same order as other collectives).
    static Result<std::unique_ptr<MpiCommunicator>> create();
    ~MpiCommunicator() override;
    MpiCommunicator(const MpiCommunicator &) = delete;
    MpiCommunicator &operator=(const MpiCommunicator &) = delete;

    int rank() const override;
    int size() const override;

    // MPI_Allgather; in place (send is this rank's slot of recv) with MPI_IN_PLACE.
    Result<void> all_gather(std::span<const std::byte> send, std::span<std::byte> recv) override;
    // MPI_Bcast.
    Result<void> broadcast(std::span<std::byte> buf, int root) override;
    // MPI_Barrier.
    Result<void> barrier() override;
    // Outside a group: send is synchronous (MPI_Ssend), so it returns once the peer's recv has taken the
    // bytes; recv (MPI_Recv) returns once they have arrived.
    Result<void> send(std::span<const std::byte> buf, int peer) override;
    Result<void> recv(std::span<std::byte> buf, int peer) override;
    // The outermost group_end posts the group's recvs, then its sends (MPI_Irecv, MPI_Isend), and waits for
    // each of them (MPI_Wait) before reporting the first failure.
    Result<void> group_start() override;
    Result<void> group_end() override;

private:
    struct State;
    explicit MpiCommunicator(std::unique_ptr<State> state);

    std::unique_ptr<State> state_;
};

#endif  // MEMRA_HAVE_MPI

}  // namespace memra::parallel
