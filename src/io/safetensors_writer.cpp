// safetensors writing: one deterministic file (sorted header, hole-free data laid out so tensors
// stay aligned without padding), and sharded checkpoints with their index. Files are written to
// a temporary name and renamed, so a failed write leaves nothing behind.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <random>
#include <system_error>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "io/strict_json.h"

namespace memra::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kTempNameAttempts = 8;  // fresh random temp names tried before giving up
constexpr uint64_t kMaxAlign = 8;     // the data alignment the writer aims for

std::string errno_message(int err) { return std::error_code(err, std::generic_category()).message(); }

// The alignment a tensor of n_bytes can keep without padding: the largest power of two up to 8
// that divides its size (8 for an empty tensor). It is at least the element size.
uint64_t natural_alignment(uint64_t n_bytes) {
    uint64_t align = kMaxAlign;
    while (align > 1 && n_bytes % align != 0) align /= 2;
    return align;
}

// The tensors of one write, each checked on its own and as a set (unique names).
Result<void> check_tensors(const std::vector<const TensorData *> &tensors) {
    std::vector<const std::string *> names;
    names.reserve(tensors.size());
    for (const TensorData *t : tensors) {
        if (t->name == "__metadata__") return make_error("tensor name '__metadata__' is reserved for the metadata");
        if (!is_valid_utf8(t->name)) return make_error("tensor name '{}' is not valid UTF-8", t->name);
        uint64_t n_elements = 1;
        bool overflow = false;
        for (size_t i = 0; i < t->shape.size(); ++i) {
            if (t->shape[i] < 0) {
                return make_error("tensor '{}': shape[{}] is {}, expected a non-negative dimension", t->name, i,
                                  t->shape[i]);
            }
            if (__builtin_mul_overflow(n_elements, static_cast<uint64_t>(t->shape[i]), &n_elements)) overflow = true;
        }
        if (std::find(t->shape.begin(), t->shape.end(), 0) != t->shape.end()) {
            n_elements = 0;
        } else if (overflow) {
            return make_error("tensor '{}': shape {} has more elements than fit in 64 bits", t->name, t->shape);
        }
        uint64_t n_bytes = 0;
        if (__builtin_mul_overflow(n_elements, static_cast<uint64_t>(dtype_size(t->dtype)), &n_bytes)) {
            return make_error("tensor '{}': {} x shape {} needs more than 2^64 bytes", t->name, dtype_name(t->dtype),
                              t->shape);
        }
        if (n_bytes != t->bytes.size()) {
            return make_error("tensor '{}': {} x shape {} needs {} bytes, found {}", t->name, dtype_name(t->dtype),
                              t->shape, n_bytes, t->bytes.size());
        }
        names.push_back(&t->name);
    }
    std::sort(names.begin(), names.end(), [](const std::string *a, const std::string *b) { return *a < *b; });
    auto dup = std::adjacent_find(names.begin(), names.end(),
                                  [](const std::string *a, const std::string *b) { return *a == *b; });
    if (dup != names.end()) return make_error("tensor '{}' appears more than once", **dup);
    return {};
}

// The 8-byte length, the JSON header padded with spaces to a multiple of 8, and the order in
// which the tensors' bytes follow it.
struct EncodedHeader {
    std::string head;
    std::vector<const TensorData *> order;
};

Result<EncodedHeader> encode_header(const std::vector<const TensorData *> &tensors,
                                    const std::map<std::string, std::string> &metadata) {
    for (const auto &[key, value] : metadata) {
        if (!is_valid_utf8(key) || !is_valid_utf8(value)) {
            return make_error("metadata entry '{}' is not valid UTF-8", key);
        }
    }
    EncodedHeader enc;
    enc.order = tensors;
    // Decreasing alignment, then name: every size before a tensor is a multiple of its own
    // alignment, so the data needs no holes (which the reference reader refuses) to stay aligned.
    std::sort(enc.order.begin(), enc.order.end(), [](const TensorData *a, const TensorData *b) {
        const uint64_t align_a = natural_alignment(a->bytes.size());
        const uint64_t align_b = natural_alignment(b->bytes.size());
        if (align_a != align_b) return align_a > align_b;
        return a->name < b->name;
    });
    json header = json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    uint64_t offset = 0;
    for (const TensorData *t : enc.order) {
        const uint64_t end = offset + t->bytes.size();
        header[t->name] = json{{"dtype", dtype_name(t->dtype)},
                               {"shape", t->shape},
                               {"data_offsets", json::array({offset, end})}};
        offset = end;
    }
    std::string text;
    try {
        text = header.dump();  // compact, keys sorted (nlohmann objects are ordered maps)
    } catch (const json::exception &err) {
        return make_error("cannot encode the header: {}", err.what());
    }
    const uint64_t header_len = (text.size() + 7) / 8 * 8;
    if (header_len > kMaxHeaderBytes) {
        return make_error("the header would be {} bytes, over the limit of {} bytes", header_len, kMaxHeaderBytes);
    }
    text.resize(header_len, ' ');
    enc.head.reserve(8 + header_len);
    for (int i = 0; i < 8; ++i) enc.head.push_back(static_cast<char>((header_len >> (8 * i)) & 0xFF));
    enc.head += text;
    return enc;
}

// Owns a temporary file next to the target; removes it unless committed.
class TempFile {
public:
    TempFile() = default;
    TempFile(const TempFile &) = delete;
    TempFile &operator=(const TempFile &) = delete;
    ~TempFile() {
        if (fd_ >= 0) ::close(fd_);
        if (!path_.empty() && !committed_) ::unlink(path_.c_str());
    }

    Result<void> create(const fs::path &target) {
        std::random_device rd;
        for (int attempt = 0; attempt < kTempNameAttempts; ++attempt) {
            const uint64_t tag = (static_cast<uint64_t>(rd()) << 32) | rd();
            std::string candidate = fmt::format("{}.tmp.{:016x}", target.string(), tag);
            const int fd = ::open(candidate.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
            if (fd >= 0) {
                fd_ = fd;
                path_ = std::move(candidate);
                return {};
            }
            if (errno != EEXIST) {
                return make_error("{}: cannot create a temporary file: {}", target.string(), errno_message(errno));
            }
        }
        return make_error("{}: cannot find an unused temporary file name", target.string());
    }

    Result<void> write(std::span<const std::byte> data, const fs::path &target) {
        while (!data.empty()) {
            const ssize_t n = ::write(fd_, data.data(), data.size());
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) return make_error("{}: write failed: {}", target.string(), errno_message(errno));
            data = data.subspan(static_cast<size_t>(n));
        }
        return {};
    }

    // fsync, close and rename over the target: the file appears complete or not at all.
    Result<void> commit(const fs::path &target) {
        if (::fsync(fd_) != 0) return make_error("{}: fsync failed: {}", target.string(), errno_message(errno));
        const int fd = fd_;
        fd_ = -1;
        if (::close(fd) != 0) return make_error("{}: close failed: {}", target.string(), errno_message(errno));
        if (::rename(path_.c_str(), target.c_str()) != 0) {
            return make_error("{}: cannot rename the temporary file into place: {}", target.string(),
                              errno_message(errno));
        }
        committed_ = true;
        return {};
    }

private:
    std::string path_;
    int fd_ = -1;
    bool committed_ = false;
};

Result<void> write_file_atomic(const fs::path &path, const std::vector<std::span<const std::byte>> &pieces) {
    TempFile tmp;
    Result<void> ok = tmp.create(path);
    for (size_t i = 0; ok && i < pieces.size(); ++i) ok = tmp.write(pieces[i], path);
    if (ok) ok = tmp.commit(path);
    return ok;
}

std::span<const std::byte> as_bytes(const std::string &s) {
    return {reinterpret_cast<const std::byte *>(s.data()), s.size()};
}

// Writes already-checked tensors to one file.
Result<void> write_checked(const fs::path &path, const std::vector<const TensorData *> &tensors,
                           const std::map<std::string, std::string> &metadata) {
    Result<EncodedHeader> enc = encode_header(tensors, metadata);
    if (!enc) return wrap_error(path.string(), enc.error());
    std::vector<std::span<const std::byte>> pieces;
    pieces.reserve(tensors.size() + 1);
    pieces.push_back(as_bytes(enc->head));
    for (const TensorData *t : enc->order) pieces.emplace_back(t->bytes);
    return write_file_atomic(path, pieces);
}

std::vector<const TensorData *> pointers_to(const std::vector<TensorData> &tensors) {
    std::vector<const TensorData *> ptrs;
    ptrs.reserve(tensors.size());
    for (const TensorData &t : tensors) ptrs.push_back(&t);
    return ptrs;
}

}  // namespace

Result<void> write_safetensors(const std::filesystem::path &path, const std::vector<TensorData> &tensors,
                               const std::map<std::string, std::string> &metadata) {
    const std::vector<const TensorData *> ptrs = pointers_to(tensors);
    Result<void> ok = check_tensors(ptrs);
    if (!ok) return wrap_error(path.string(), ok.error());
    return write_checked(path, ptrs, metadata);
}

Result<void> write_sharded_checkpoint(const std::filesystem::path &dir, const std::vector<TensorData> &tensors,
                                      uint64_t max_shard_bytes) {
    if (max_shard_bytes == 0) return make_error("{}: max_shard_bytes must be positive", dir.string());
    if (tensors.empty()) return make_error("{}: a sharded checkpoint needs at least one tensor", dir.string());
    const std::vector<const TensorData *> ptrs = pointers_to(tensors);
    Result<void> ok = check_tensors(ptrs);
    if (!ok) return wrap_error(dir.string(), ok.error());
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return make_error("{}: cannot create the directory: {}", dir.string(), ec.message());
    if (fs::exists(dir / "model.safetensors", ec)) {
        return make_error("{}: holds a model.safetensors, which would make the checkpoint ambiguous", dir.string());
    }

    // Greedy packing in the given order; a tensor larger than the limit gets a shard of its own.
    std::vector<std::vector<const TensorData *>> shards;
    uint64_t shard_bytes = 0;
    for (const TensorData *t : ptrs) {
        if (shards.empty() || (shard_bytes + t->bytes.size() > max_shard_bytes && !shards.back().empty())) {
            shards.emplace_back();
            shard_bytes = 0;
        }
        shards.back().push_back(t);
        shard_bytes += t->bytes.size();
    }

    json weight_map = json::object();
    uint64_t total_size = 0;
    std::vector<fs::path> written;
    for (size_t s = 0; s < shards.size(); ++s) {
        const std::string name = fmt::format("model-{:05}-of-{:05}.safetensors", s + 1, shards.size());
        ok = write_checked(dir / name, shards[s], {});
        if (!ok) break;
        written.push_back(dir / name);
        for (const TensorData *t : shards[s]) {
            weight_map[t->name] = name;
            total_size += t->bytes.size();
        }
    }
    if (ok) {
        json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
        const std::string text = index.dump(2) + "\n";  // names were checked to be UTF-8
        ok = write_file_atomic(dir / kIndexFileName, {as_bytes(text)});
    }
    if (!ok) {
        for (const fs::path &p : written) fs::remove(p, ec);
    }
    return ok;
}

}  // namespace memra::io
