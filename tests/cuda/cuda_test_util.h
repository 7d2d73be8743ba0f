// Helpers of the GPU tests: an owning device buffer with typed host transfers. Tests skip without a GPU
// (MEMRA_SKIP_WITHOUT_GPU) so the suite runs, and passes, on machines that only compile CUDA code.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "backend/cuda/convert.h"

#define MEMRA_SKIP_WITHOUT_GPU() \
    if (::memra::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible"

namespace memra {

// An owning device allocation of `bytes` bytes.
class DeviceBuffer {
public:
    explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
        EXPECT_EQ(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes), cudaSuccess);
    }
    ~DeviceBuffer() { cudaFree(ptr_); }
    DeviceBuffer(const DeviceBuffer &) = delete;
    DeviceBuffer &operator=(const DeviceBuffer &) = delete;
    DeviceBuffer(DeviceBuffer &&o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
    DeviceBuffer &operator=(DeviceBuffer &&) = delete;

    void upload(const void *host) { ASSERT_EQ(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess); }
    void download(void *host) const {
        ASSERT_EQ(cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    template <class T>
    T *as() const {
        return static_cast<T *>(ptr_);
    }

private:
    void *ptr_ = nullptr;
    size_t bytes_;
};

// A device copy of a host vector.
template <class T>
DeviceBuffer to_device(const std::vector<T> &host) {
    DeviceBuffer b(host.size() * sizeof(T));
    b.upload(host.data());
    return b;
}

// The device buffer's contents as n elements of T (waits for the work before it).
template <class T>
std::vector<T> from_device(const DeviceBuffer &b, size_t n) {
    std::vector<T> v(n);
    b.download(v.data());
    return v;
}

}  // namespace memra
