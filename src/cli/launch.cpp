// A multi-process launch (commands.h ProcessLaunch): under Open MPI's mpirun each process runs one tensor-parallel
// rank of `run`, `bench` or `perplexity`. MPI only starts the processes, tells each its rank and carries the
// ranks' traffic on the CPU (parallel::MpiCommunicator) or, on GPUs, the NCCL id from rank 0 to the others; the
// engine in every process plans the same steps, so only rank 0 writes to stdout.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "cli/commands.h"

#ifdef MEMRA_HAVE_MPI
#include "parallel/mpi_comm.h"
#endif
#if defined(MEMRA_HAVE_CUDA) && defined(MEMRA_HAVE_NCCL)
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/nccl_comm.h"
#endif

namespace memra::cli {

namespace {

ProcessLaunch &launch_state() {
    static ProcessLaunch launch;
    return launch;
}

#ifdef MEMRA_HAVE_MPI
bool runs_one_rank_per_process(const std::string &command) {
    return command == "run" || command == "bench" || command == "perplexity";
}

// This process's one communicator, as the engine's factory returns it.
template <class C>
Result<std::vector<std::unique_ptr<parallel::Communicator>>> only(Result<std::unique_ptr<C>> comm) {
    if (!comm) return tl::unexpected(comm.error());
    std::vector<std::unique_ptr<parallel::Communicator>> out;
    out.push_back(std::move(*comm));
    return out;
}
#endif

}  // namespace

const ProcessLaunch &process_launch() { return launch_state(); }

Result<void> start_launch(const std::string &command) {
#ifdef MEMRA_HAVE_MPI
    if (!parallel::launched_by_mpi()) return {};
    auto world = parallel::mpi_init();
    if (!world) return wrap_error("mpirun launch", world.error());
    launch_state() = ProcessLaunch{world->rank, world->size, world->local_rank, world->local_size};
    if (world->size == 1) return {};
    if (!runs_one_rank_per_process(command)) {
        return make_error("mpirun started {} processes, but `memra {}` runs its ranks as threads of one process (--tp); "
                          "under mpirun only run, bench and perplexity run, one rank per process",
                          world->size, command);
    }
    // Every process computes the same output; rank 0 writes it.
    if (world->rank > 0 && std::freopen("/dev/null", "w", stdout) == nullptr) {
        return make_error("mpirun launch: rank {} could not silence its stdout", world->rank);
    }
    return {};
#else
    (void)command;
    const char *size = std::getenv("OMPI_COMM_WORLD_SIZE");
    if (size != nullptr && std::string(size) != "1") {
        return make_error("mpirun started {} processes, but this memra was built without MPI (install libopenmpi-dev "
                          "and rebuild: scripts/setup.sh)",
                          size);
    }
    return {};
#endif
}

int end_launch(int exit_code) {
#ifdef MEMRA_HAVE_MPI
    if (launch_state().size > 1 && exit_code != 0) {
        // A rank that failed must not leave its peers waiting in a collective: stop the whole job.
        std::fflush(stdout);
        std::fflush(stderr);
        parallel::mpi_abort(exit_code);
    }
    parallel::mpi_finalize();
#endif
    return exit_code;
}

Result<void> apply_launch(runtime::EngineOptions &options, [[maybe_unused]] Device device) {
    const ProcessLaunch &pl = process_launch();
    if (pl.size == 1) return {};
    if (options.tp != pl.size) {
        return make_error("mpirun started {} processes: --tp must be {} (one rank per process), found {}", pl.size,
                          pl.size, options.tp);
    }
    options.process_rank = pl.rank;
#ifdef MEMRA_HAVE_MPI
#if defined(MEMRA_HAVE_CUDA) && defined(MEMRA_HAVE_NCCL)
    if (device == Device::kCuda) {
        // Rank 0 makes the NCCL id; MPI carries it to the other processes; the ranks then talk over NCCL.
        options.make_comms = [pl](std::span<Backend *const> backends)
            -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
            auto *cb = backends.size() == 1 ? dynamic_cast<cuda::CudaBackend *>(backends[0]) : nullptr;
            if (cb == nullptr) return make_error("mpirun launch: expected this process's one CUDA rank");
            cuda::NcclId id;
            if (pl.rank == 0) {
                auto made = cuda::NcclId::make();
                if (!made) return tl::unexpected(made.error());
                id = *made;
            }
            if (auto ok = parallel::mpi_broadcast(std::as_writable_bytes(std::span(id.bytes)), 0); !ok) {
                return wrap_error("mpirun launch: the NCCL id", ok.error());
            }
            return only(cuda::NcclCommunicator::create(id, pl.size, pl.rank, cb->device_index(), cb->stream()));
        };
        return {};
    }
#endif
    options.make_comms = [](std::span<Backend *const>) -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
        return only(parallel::MpiCommunicator::create());
    };
    return {};
#else
    return make_error("mpirun launch: this memra was built without MPI");
#endif
}

}  // namespace memra::cli
