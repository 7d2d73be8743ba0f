// SyntheticStore: a make-tiny checkpoint that is never written, its tensors generated in host memory on demand
// (io::TensorStore), for models too large for a disk (Step-3.5-E128, ~100 GB). It lists exactly the tensors
// make_tiny_tensors produces (names, dtypes, shapes, order) and gives each one the same bytes.
//
// Memory: a tensor is generated at its first get() (on the store's threads; an FP8 tensor's codes and scales
// together) and held until every get of it has been released; releasing one half of an FP8 tensor also frees the
// other half when nobody holds it (freed memory serves the next tensors). Bound to a backend that copies (CUDA:
// Backend::keeps_host_views() false), the binder releases each tensor after its upload, so at most one tensor
// (plus its scales) is in host memory at a time; bound to the CPU backend, every tensor stays held for the store's
// life (the backend's views point into it). A tensor released and asked for again (by the next TP rank) is
// generated again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/thread_pool.h"
#include "io/tensor_store.h"
#include "make_tiny/tiny_presets.h"
#include "make_tiny/tiny_weights.h"

namespace memra::tools {

// What the store has generated so far.
struct SyntheticStats {
    uint64_t tensors = 0;     // tensors generated (a tensor generated twice counts twice; FP8 scales included)
    uint64_t bytes = 0;       // their bytes
    double seconds = 0.0;     // wall time spent generating them
    uint64_t held_bytes = 0;  // bytes held now
    uint64_t peak_held_bytes = 0;
    int threads = 0;          // the generation threads

    double gb_per_s() const { return seconds > 0.0 ? 1e-9 * static_cast<double>(bytes) / seconds : 0.0; }
};

class SyntheticStore final : public io::TensorStore {
public:
    // preset: with its overrides applied (resolve_tiny_model). n_threads >= 1 generate each tensor.
    SyntheticStore(const TinyPreset &preset, uint64_t seed, bool fp8, int n_threads);
    ~SyntheticStore() override;
    SyntheticStore(const SyntheticStore &) = delete;
    SyntheticStore &operator=(const SyntheticStore &) = delete;

    // io::TensorStore. get() and release() may be called from several threads.
    std::vector<std::string> names() const override;
    size_t n_tensors() const override { return weights_.tensors().size(); }
    const io::TensorInfo *find(std::string_view name) const override;
    Result<io::TensorRef> get(std::string_view name) const override;
    void release(std::string_view name) const override;
    uint64_t total_bytes() const override { return weights_.total_bytes(); }

    const TinyPreset &preset() const { return preset_; }
    uint64_t seed() const { return seed_; }
    bool fp8() const { return fp8_; }
    // Every tensor in make-tiny's checkpoint order, without generating anything.
    const std::vector<TinyTensor> &tensors() const { return weights_.tensors(); }
    // The config.json make-tiny writes for this model (its tokenizer's ids in eos_token_id), for
    // model::parse_step35_config.
    std::string config_json() const;
    SyntheticStats stats() const;

private:
    struct FreeBytes {
        void operator()(std::byte *p) const;
    };
    // Host memory for a tensor. From 2 MiB on it is 2 MiB-aligned and marked for transparent huge pages (a
    // 100 GB model would otherwise take 25 million page faults on first touch), and a freed one is kept for
    // the next tensor that fits (its pages are mapped already: the kernel need not zero them again).
    struct Buffer {
        std::unique_ptr<std::byte, FreeBytes> bytes;  // nullptr: none
        uint64_t capacity = 0;
    };
    // A buffer of at least n bytes: the smallest spare that fits, else a new one (bytes null when the host is
    // out of memory). Under mu_.
    Buffer take_locked(uint64_t n) const;
    // Keeps a large buffer as a spare (at most kMaxSpares, the smallest dropped first). Under mu_.
    void give_locked(Buffer buffer) const;

    struct Slot {
        Buffer buffer;     // bytes null: not generated (or freed)
        int64_t pins = 0;  // gets not yet released
    };
    // Generates tensor i (and its FP8 other half, unless that one is held) into its slot; an error, with nothing
    // changed, when the host memory for it cannot be had. Under mu_.
    Result<void> generate_locked(size_t i) const;
    void free_locked(size_t i) const;

    TinyPreset preset_;
    uint64_t seed_ = 0;
    bool fp8_ = false;
    TinyWeights weights_;
    std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors()
    std::unique_ptr<ThreadPool> pool_;
    mutable std::mutex mu_;
    mutable std::vector<Slot> slots_;  // [tensor]
    mutable std::vector<Buffer> spares_;
    mutable SyntheticStats stats_;
};

}  // namespace memra::tools
