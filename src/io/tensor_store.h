// TensorStore: read access by name to the tensors of a model, whatever holds them: a mapped checkpoint
// (io::Checkpoint) or a model generated in memory from a seed (tools::SyntheticStore). The binder, the engine
// and verify read weights only through it.
//
// Lifetime rule. get() returns a view that stays valid until the caller gives it back with release(name)
// (each get is matched by at most one release) or the store is destroyed. A store that produces tensors on
// demand materializes a tensor at its first get and may free it once every get has been released; a
// checkpoint's views are its mmap and release does nothing. Who releases: the binder, after uploading a tensor
// to a backend that copies it (Backend::keeps_host_views() false, CUDA); a backend that keeps views (CPU) gets
// views that must outlive it, so nothing is released and the whole model stays in host memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/result.h"

namespace memra::io {

struct TensorInfo {
    std::string name;
    DType dtype = DType::kF32;
    std::vector<int64_t> shape;  // outermost first (PyTorch order); empty = scalar
    uint64_t data_begin = 0;     // byte offsets relative to the start of the data section (a store without
    uint64_t data_end = 0;       // files: of the concatenation of its tensors in the store's order)

    uint64_t n_elements() const;  // product of shape (1 for a scalar)
    uint64_t n_bytes() const { return data_end - data_begin; }
};

// A zero-copy view of one tensor's bytes.
struct TensorRef {
    const TensorInfo *info = nullptr;
    std::span<const std::byte> bytes;  // exactly info->n_bytes() bytes, little-endian

    // Typed view; an Error if T does not match the dtype's size or the data is misaligned for T.
    template <class T>
    Result<std::span<const T>> as() const {
        if (sizeof(T) != dtype_size(info->dtype)) {
            return make_error("tensor {}: element size {} requested, dtype {} has {}", info->name, sizeof(T),
                              dtype_name(info->dtype), dtype_size(info->dtype));
        }
        if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(T) != 0) {
            return make_error("tensor {}: data is not {}-byte aligned in the file", info->name, alignof(T));
        }
        return std::span<const T>(reinterpret_cast<const T *>(bytes.data()), bytes.size() / sizeof(T));
    }
};

class TensorStore {
public:
    virtual ~TensorStore() = default;

    virtual std::vector<std::string> names() const = 0;  // all tensor names, sorted
    virtual size_t n_tensors() const = 0;
    // The tensor's name, dtype and shape without producing its bytes; nullptr when absent. The pointer lives as
    // long as the store.
    virtual const TensorInfo *find(std::string_view name) const = 0;
    // The tensor's bytes (see the lifetime rule above); an Error naming the tensor when absent.
    virtual Result<TensorRef> get(std::string_view name) const = 0;
    // Gives back one get() of name: its view may no longer be used. Unknown names are ignored.
    virtual void release(std::string_view name) const { (void)name; }
    virtual uint64_t total_bytes() const = 0;  // sum of the tensors' bytes

protected:
    TensorStore() = default;
    TensorStore(const TensorStore &) = default;
    TensorStore(TensorStore &&) = default;
    TensorStore &operator=(const TensorStore &) = default;
    TensorStore &operator=(TensorStore &&) = default;
};

}  // namespace memra::io
