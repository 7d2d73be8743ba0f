// TensorView: a non-owning description of a buffer a backend owns (dtype, shape, data pointer, device).
// Views are contiguous and row-major, outermost dimension first; the forward recipe slices them by rows
// (tokens) and hands them to backend ops. A view never allocates and never frees.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/check.h"
#include "core/dtype.h"

namespace memra {

enum class Device : uint8_t {
    kCpu,   // host memory: data is a host pointer
    kCuda,  // device memory of one GPU: data is a device pointer, never dereferenced on the host
};

// Tensors the forward handles have at most this many dimensions ([n_tokens, n_heads, head_dim] is the
// widest); a fixed small array keeps views trivially copyable and free of allocation.
inline constexpr int kTensorMaxRank = 4;

struct TensorView {
    void *data = nullptr;
    DType dtype = DType::kF32;
    Device device = Device::kCpu;
    int device_index = 0;  // which GPU for kCuda; 0 on the host
    int rank = 0;
    std::array<int64_t, kTensorMaxRank> shape{};  // outermost first; entries past rank are unused

    int64_t dim(int i) const {
        MEMRA_CHECK(i >= 0 && i < rank, "dim {} of a rank-{} view", i, rank);
        return shape[static_cast<size_t>(i)];
    }
    // Number of rows (outermost dimension; 1 for a scalar view).
    int64_t rows() const { return rank == 0 ? 1 : shape[0]; }
    // Elements per row: the product of every dimension but the first.
    int64_t row_elems() const {
        int64_t n = 1;
        for (int i = 1; i < rank; ++i) n *= shape[static_cast<size_t>(i)];
        return n;
    }
    int64_t numel() const { return rows() * row_elems(); }
    size_t n_bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }

    // Rows [r0, r1) as a view of the same buffer (0 <= r0 <= r1 <= rows(): MEMRA_CHECK).
    TensorView row_slice(int64_t r0, int64_t r1) const {
        MEMRA_CHECK(rank >= 1 && r0 >= 0 && r0 <= r1 && r1 <= shape[0], "row slice [{}, {}) of {} rows", r0, r1,
                    rows());
        TensorView v = *this;
        v.shape[0] = r1 - r0;
        v.data = static_cast<std::byte *>(data) + static_cast<size_t>(r0 * row_elems()) * dtype_size(dtype);
        return v;
    }

    // The same bytes under another shape with the same element count (MEMRA_CHECK).
    TensorView reshaped(std::initializer_list<int64_t> new_shape) const {
        MEMRA_CHECK(new_shape.size() >= 1 && new_shape.size() <= kTensorMaxRank, "rank {}", new_shape.size());
        TensorView v = *this;
        v.rank = static_cast<int>(new_shape.size());
        v.shape = {};
        int64_t n = 1;
        size_t i = 0;
        for (int64_t d : new_shape) {
            v.shape[i++] = d;
            n *= d;
        }
        MEMRA_CHECK(n == numel(), "reshape of {} elements to {}", numel(), n);
        return v;
    }
};

}  // namespace memra
