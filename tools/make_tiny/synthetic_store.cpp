// The synthetic store: make-tiny's tensor list (TinyWeights) with a slot per tensor that holds its bytes while
// some get() of it is not released. Generation runs under the store's lock: a tensor is generated once however
// many callers ask for it at the same time, and is already split over the store's threads.
#include "make_tiny/synthetic_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "core/check.h"
#include "make_tiny/tiny_tokenizer.h"

namespace memra::tools {

namespace {

constexpr uint64_t kHugePage = uint64_t{2} << 20;
// Spare buffers kept: a backend that copies holds one tensor (and its FP8 scales) at a time, so a few spares
// serve every size that comes after the first layer.
constexpr size_t kMaxSpares = 4;

}  // namespace

void SyntheticStore::FreeBytes::operator()(std::byte *p) const { std::free(p); }

SyntheticStore::Buffer SyntheticStore::take_locked(uint64_t n) const {
    auto best = spares_.end();
    for (auto it = spares_.begin(); it != spares_.end(); ++it) {
        if (it->capacity >= n && (best == spares_.end() || it->capacity < best->capacity)) best = it;
    }
    if (best != spares_.end()) {
        Buffer b = std::move(*best);
        spares_.erase(best);
        return b;
    }
    Buffer b;
    if (n < kHugePage) {
        b.capacity = std::max<uint64_t>(n, 1);
        b.bytes.reset(static_cast<std::byte *>(std::malloc(b.capacity)));
    } else {
        b.capacity = (n + kHugePage - 1) / kHugePage * kHugePage;
        b.bytes.reset(static_cast<std::byte *>(std::aligned_alloc(kHugePage, b.capacity)));
        if (b.bytes) (void)madvise(b.bytes.get(), b.capacity, MADV_HUGEPAGE);  // a hint: the bytes are the same
    }
    return b;
}

void SyntheticStore::give_locked(Buffer buffer) const {
    if (buffer.capacity < kHugePage) return;  // small ones go back to malloc
    spares_.push_back(std::move(buffer));
    if (spares_.size() > kMaxSpares) {
        spares_.erase(std::min_element(spares_.begin(), spares_.end(),
                                       [](const Buffer &a, const Buffer &b) { return a.capacity < b.capacity; }));
    }
}

SyntheticStore::SyntheticStore(const TinyPreset &preset, uint64_t seed, bool fp8, int n_threads)
    : preset_(preset),
      seed_(seed),
      fp8_(fp8),
      weights_(preset, seed, fp8),
      pool_(std::make_unique<ThreadPool>(n_threads)),
      slots_(weights_.tensors().size()) {
    for (size_t i = 0; i < weights_.tensors().size(); ++i) index_.emplace(weights_.tensors()[i].info.name, i);
    stats_.threads = n_threads;
}

SyntheticStore::~SyntheticStore() = default;

std::vector<std::string> SyntheticStore::names() const {
    std::vector<std::string> names;
    names.reserve(index_.size());
    for (const auto &[name, i] : index_) names.push_back(name);
    return names;
}

const io::TensorInfo *SyntheticStore::find(std::string_view name) const {
    auto it = index_.find(name);
    return it == index_.end() ? nullptr : &weights_.tensors()[it->second].info;
}

Result<io::TensorRef> SyntheticStore::get(std::string_view name) const {
    auto it = index_.find(name);
    if (it == index_.end()) {
        return make_error("synthetic {}: tensor '{}' not found in the model", preset_.name, name);
    }
    const size_t i = it->second;
    std::lock_guard lock(mu_);
    if (!slots_[i].buffer.bytes) {
        if (auto made = generate_locked(i); !made) return tl::unexpected(made.error());
    }
    ++slots_[i].pins;
    const io::TensorInfo &info = weights_.tensors()[i].info;
    return io::TensorRef{&info, {slots_[i].buffer.bytes.get(), info.n_bytes()}};
}

void SyntheticStore::release(std::string_view name) const {
    auto it = index_.find(name);
    if (it == index_.end()) return;
    const size_t i = it->second;
    std::lock_guard lock(mu_);
    Slot &slot = slots_[i];
    if (slot.pins == 0) return;
    if (--slot.pins > 0) return;
    free_locked(i);
    // The other half of an FP8 tensor, generated with this one, goes too unless someone holds it.
    const TinyTensor &t = weights_.tensors()[i];
    const size_t other = t.part == TinyPart::kFp8Codes ? i + 1 : t.part == TinyPart::kFp8Scales ? i - 1 : i;
    if (other != i && slots_[other].pins == 0) free_locked(other);
}

Result<void> SyntheticStore::generate_locked(size_t i) const {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<TinyTensor> &tensors = weights_.tensors();
    const TinyTensor &t = tensors[i];
    // Codes and scales come out of one pass: both halves of an FP8 tensor get a buffer, a half still held (views
    // of it are live) a spare whose copy is dropped afterwards.
    const size_t first = t.part == TinyPart::kFp8Scales ? i - 1 : i;
    const size_t n_parts = t.part == TinyPart::kValues ? 1 : 2;
    Buffer buffers[2];
    for (size_t k = 0; k < n_parts; ++k) {
        const uint64_t n = tensors[first + k].info.n_bytes();
        buffers[k] = take_locked(n);
        if (!buffers[k].bytes) {
            for (Buffer &taken : buffers) {
                if (taken.bytes) give_locked(std::move(taken));
            }
            return make_error("synthetic {}: tensor {}: out of host memory for its {} bytes", preset_.name,
                              tensors[first + k].info.name, n);
        }
    }
    std::span<std::byte> out[2];
    for (size_t k = 0; k < n_parts; ++k) out[k] = {buffers[k].bytes.get(), tensors[first + k].info.n_bytes()};
    if (n_parts == 1) {
        weights_.generate(first, out[0], *pool_);
    } else {
        weights_.generate_fp8(first, out[0], out[1], *pool_);
    }
    for (size_t k = 0; k < n_parts; ++k) {
        Slot &slot = slots_[first + k];
        if (slot.buffer.bytes) {  // the held half: its bytes stay, the new copy is a spare again
            give_locked(std::move(buffers[k]));
            continue;
        }
        const uint64_t n = tensors[first + k].info.n_bytes();
        slot.buffer = std::move(buffers[k]);
        stats_.held_bytes += n;
        stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, stats_.held_bytes);
        stats_.bytes += n;
        ++stats_.tensors;
    }
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return {};
}

void SyntheticStore::free_locked(size_t i) const {
    Slot &slot = slots_[i];
    if (!slot.buffer.bytes) return;
    MEMRA_CHECK(slot.pins == 0, "synthetic store: freeing {} while held", weights_.tensors()[i].info.name);
    give_locked(std::move(slot.buffer));
    slot.buffer = Buffer{};
    stats_.held_bytes -= weights_.tensors()[i].info.n_bytes();
}

std::string SyntheticStore::config_json() const {
    return tiny_config_json(preset_, build_tiny_tokenizer().im_end_id, fp8_);
}

SyntheticStats SyntheticStore::stats() const {
    std::lock_guard lock(mu_);
    return stats_;
}

}  // namespace memra::tools
