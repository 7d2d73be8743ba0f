#include "backend/cuda/launch.cuh"

#include <cstdlib>
#include <string_view>

namespace memra::cuda {

bool pdl_enabled() {
    static const bool enabled = [] {
        const char *env = std::getenv("MEMRA_CUDA_PDL");
        if (env != nullptr && std::string_view(env) == "0") return false;
        int device = 0, major = 0;
        return cudaGetDevice(&device) == cudaSuccess &&
               cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
    }();
    return enabled;
}

}  // namespace memra::cuda
