// safetensors: strict reader (mmap, zero-copy views, single file or sharded with
// model.safetensors.index.json) and a deterministic writer. Every malformed input is reported
// as one Error naming the file, the tensor and what was expected; nothing is ever half-loaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/result.h"
#include "io/tensor_store.h"

namespace memra::io {

inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // same limit as the reference implementation
inline constexpr char kIndexFileName[] = "model.safetensors.index.json";

struct SafetensorsHeader {
    uint64_t header_len = 0;                      // the 8-byte little-endian length field
    std::vector<TensorInfo> tensors;              // sorted by name
    std::map<std::string, std::string> metadata;  // "__metadata__" (string -> string only)
};

// Parses and validates a complete safetensors file image: 8-byte length, JSON header, data.
// Refuses: a file shorter than 8 bytes; a header length over kMaxHeaderBytes or past the end of
// the file; invalid JSON or a header that is not an object; unknown dtype; negative or overflowing
// shapes; offsets that are not [begin, end] with begin <= end, or that run past the data section;
// a byte size that disagrees with dtype x shape; overlapping tensors; duplicate names; metadata
// that is not string -> string. Like the reference reader, the tensors must cover the data
// section exactly: a hole between tensors or trailing bytes after the last one is refused.
// The fuzz target calls this directly.
Result<SafetensorsHeader> parse_safetensors(std::span<const std::byte> file_bytes);

// A read-only memory map of a whole file (RAII, move-only).
class MappedFile {
public:
    static Result<MappedFile> open(const std::filesystem::path &path);
    MappedFile() = default;
    MappedFile(MappedFile &&other) noexcept;
    MappedFile &operator=(MappedFile &&other) noexcept;
    MappedFile(const MappedFile &) = delete;
    MappedFile &operator=(const MappedFile &) = delete;
    ~MappedFile();

    std::span<const std::byte> bytes() const { return {data_, size_}; }
    const std::filesystem::path &path() const { return path_; }

private:
    std::filesystem::path path_;
    const std::byte *data_ = nullptr;
    size_t size_ = 0;
};

// One mapped, validated safetensors file.
class SafetensorsFile {
public:
    static Result<SafetensorsFile> open(const std::filesystem::path &path);

    const std::filesystem::path &path() const { return file_.path(); }
    const SafetensorsHeader &header() const { return header_; }
    const std::vector<TensorInfo> &tensors() const { return header_.tensors; }
    const TensorInfo *find(std::string_view name) const;  // nullptr when absent
    TensorRef ref(const TensorInfo &info) const;
    uint64_t file_size() const { return file_.bytes().size(); }

private:
    MappedFile file_;
    SafetensorsHeader header_;
    uint64_t data_offset_ = 0;  // 8 + header_len
};

// Called once per shard as a checkpoint is mapped and validated.
using ShardProgress = std::function<void(size_t shards_done, size_t shards_total, const std::filesystem::path &)>;

// A checkpoint directory: either one model.safetensors, or shards listed in
// model.safetensors.index.json. Validation is strict: every shard in the index exists and parses,
// every tensor the index names is in the shard it names, no tensor is in two shards, and no shard
// holds a tensor the index does not list. A single file path is accepted as a one-shard checkpoint.
// A directory holding both model.safetensors and the index is refused as ambiguous.
// As a TensorStore its views are the mmap itself: valid for the checkpoint's life, release() does nothing.
class Checkpoint final : public TensorStore {
public:
    static Result<Checkpoint> open(const std::filesystem::path &dir_or_file, const ShardProgress &progress = {});

    const std::filesystem::path &root() const { return root_; }  // the directory (a single file's parent)
    size_t n_shards() const { return shards_.size(); }
    const SafetensorsFile &shard(size_t i) const { return *shards_[i]; }
    std::vector<std::string> names() const override;  // all tensor names, sorted
    size_t n_tensors() const override { return by_name_.size(); }
    const TensorInfo *find(std::string_view name) const override;  // nullptr when absent
    Result<TensorRef> get(std::string_view name) const override;    // Error naming the tensor when absent
    uint64_t total_bytes() const override;                          // sum of tensor bytes over all shards

private:
    struct Entry {
        size_t shard;
        const TensorInfo *info;
    };
    std::filesystem::path root_;
    std::vector<std::unique_ptr<SafetensorsFile>> shards_;
    std::map<std::string, Entry, std::less<>> by_name_;
};

// An owned tensor for writing.
struct TensorData {
    std::string name;
    DType dtype = DType::kF32;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;  // n_elements x dtype_size bytes, little-endian
};

// Writes one safetensors file deterministically: header keys sorted by name, the header padded
// with spaces to a multiple of 8. The data section has no holes (the reference reader refuses
// them), so instead of padding, tensors are laid out by decreasing alignment (the largest power of
// two up to 8 dividing the tensor's byte size), then by name: every tensor starts at a multiple of
// its element size, and at a multiple of 8 whenever its byte size is one. Written to a temporary
// file and renamed, so a failure leaves no partial file. Refuses duplicate names, the name
// "__metadata__", negative dimensions and byte sizes that disagree with dtype x shape.
Result<void> write_safetensors(const std::filesystem::path &path, const std::vector<TensorData> &tensors,
                               const std::map<std::string, std::string> &metadata = {});

// Writes a sharded checkpoint into dir: tensors (in the given order) are packed into shards of at
// most max_shard_bytes of data each (a larger tensor gets a shard of its own), named
// model-00001-of-0000N.safetensors, plus model.safetensors.index.json with metadata.total_size
// and a sorted weight_map. With one shard the index is still written. Refuses an empty tensor
// list, max_shard_bytes 0 and a dir that already holds model.safetensors; a failure removes the
// shards this call wrote and writes no index.
Result<void> write_sharded_checkpoint(const std::filesystem::path &dir, const std::vector<TensorData> &tensors,
                                      uint64_t max_shard_bytes);

}  // namespace memra::io
