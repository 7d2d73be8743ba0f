// Programmatic dependent launch (CUDA.md 4): the step's kernels go out with the programmatic stream
// serialization attribute, so that a kernel's blocks are launched and waiting while the kernel before it
// finishes (in a CUDA graph the edge stays programmatic), and every kernel launched so calls pdl_enter() before
// it reads anything an earlier kernel of the stream writes (before it, it may only read the model's weights,
// which no kernel writes): griddepcontrol.wait (returns once the kernel before has completed and its writes are
// visible; at once when the launch was not programmatic), then griddepcontrol.launch_dependents (the kernel
// after may launch its blocks now). So each kernel still sees every earlier one complete: the order, and the
// bits, are a plain launch's. MEMRA_CUDA_PDL=0 launches plainly (to measure the difference).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace memra::cuda {

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether launch_kernel adds the attribute: compute capability 9.0 or later and MEMRA_CUDA_PDL not "0" (read
// once per process).
bool pdl_enabled();

// kernel<<<grid, block, smem, stream>>>(args...) with the attribute where pdl_enabled(). The kernel must open
// with pdl_enter(). The launch's error, as cudaGetLastError will also report it.
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args &&...args) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = pdl_enabled() ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace memra::cuda
