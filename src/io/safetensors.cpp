// safetensors reading: the strict header parser (parse_safetensors), the read-only memory map and
// one validated file with zero-copy tensor views. The layout rules follow the reference reader
// (huggingface/safetensors), including its demand that tensors cover the data section with no
// holes; where it is lax (duplicate keys, unknown fields) this reader refuses.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <system_error>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/strict_json.h"

namespace memra::io {
namespace {

using nlohmann::json;

constexpr size_t kLengthFieldBytes = 8;  // the little-endian u64 header length that opens every file
constexpr size_t kMaxQuotedChars = 60;   // a malformed value is quoted in messages up to this length

std::string errno_message(int err) { return std::error_code(err, std::generic_category()).message(); }

uint64_t read_le64(const std::byte *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | std::to_integer<uint64_t>(p[i]);
    return v;
}

// A malformed JSON value as it appears in the file, shortened for a one-line message.
std::string quote_json(const json &value) {
    std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
    if (s.size() > kMaxQuotedChars) s = s.substr(0, kMaxQuotedChars) + "...";
    return s;
}

// A JSON number that is a non-negative integer representable in 64 bits; nullopt otherwise
// (negative, fractional, too large, or not a number).
std::optional<uint64_t> json_to_u64(const json &value) {
    if (value.is_number_unsigned()) return value.get<uint64_t>();
    if (value.is_number_integer() && value.get<int64_t>() >= 0) return static_cast<uint64_t>(value.get<int64_t>());
    return std::nullopt;
}

constexpr std::string_view kTensorFields[] = {"dtype", "shape", "data_offsets"};

std::string known_dtype_list() {
    std::string list;
    for (DType t : kAllDTypes) {
        if (!list.empty()) list += ", ";
        list += dtype_name(t);
    }
    return list;
}

// One header entry -> TensorInfo, with every per-tensor check; the layout checks that involve
// several tensors (overlap, holes) come after all entries parsed.
Result<TensorInfo> parse_tensor_entry(const std::string &name, const json &entry, uint64_t data_size) {
    if (!entry.is_object()) {
        return make_error("tensor '{}': expected an object with dtype, shape and data_offsets, found {} {}", name,
                          entry.type_name(), quote_json(entry));
    }
    for (const auto &[key, value] : entry.items()) {
        if (std::find(std::begin(kTensorFields), std::end(kTensorFields), key) == std::end(kTensorFields)) {
            return make_error("tensor '{}': unexpected field '{}' (expected only dtype, shape and data_offsets)", name,
                              key);
        }
    }
    for (std::string_view field : kTensorFields) {
        if (!entry.contains(field)) return make_error("tensor '{}': missing field '{}'", name, field);
    }

    TensorInfo info;
    info.name = name;

    const json &dtype = entry.at("dtype");
    if (!dtype.is_string()) {
        return make_error("tensor '{}': field 'dtype' must be a string, found {} {}", name, dtype.type_name(),
                          quote_json(dtype));
    }
    std::optional<DType> parsed_dtype = dtype_from_name(dtype.get_ref<const std::string &>());
    if (!parsed_dtype) {
        return make_error("tensor '{}': unknown dtype '{}' (known: {})", name, dtype.get_ref<const std::string &>(),
                          known_dtype_list());
    }
    info.dtype = *parsed_dtype;

    const json &shape = entry.at("shape");
    if (!shape.is_array()) {
        return make_error("tensor '{}': field 'shape' must be an array of non-negative integers, found {} {}", name,
                          shape.type_name(), quote_json(shape));
    }
    uint64_t n_elements = 1;
    bool count_overflows = false;
    for (size_t i = 0; i < shape.size(); ++i) {
        std::optional<uint64_t> dim = json_to_u64(shape[i]);
        if (!dim) {
            return make_error("tensor '{}': shape[{}] is {}, expected a non-negative integer", name, i,
                              quote_json(shape[i]));
        }
        if (*dim > static_cast<uint64_t>(INT64_MAX)) {
            return make_error("tensor '{}': shape[{}] is {}, larger than the int64 limit", name, i, *dim);
        }
        info.shape.push_back(static_cast<int64_t>(*dim));
        if (__builtin_mul_overflow(n_elements, *dim, &n_elements)) count_overflows = true;
    }
    // A zero dimension makes the tensor empty whatever the other dimensions are.
    const bool empty = std::find(info.shape.begin(), info.shape.end(), 0) != info.shape.end();
    if (empty) {
        n_elements = 0;
    } else if (count_overflows) {
        return make_error("tensor '{}': shape {} has more elements than fit in 64 bits", name, info.shape);
    }
    uint64_t expected_bytes = 0;
    if (__builtin_mul_overflow(n_elements, static_cast<uint64_t>(dtype_size(info.dtype)), &expected_bytes)) {
        return make_error("tensor '{}': {} x shape {} overflows 64 bits of bytes", name, dtype_name(info.dtype),
                          info.shape);
    }

    const json &offsets = entry.at("data_offsets");
    std::optional<uint64_t> begin;
    std::optional<uint64_t> end;
    if (offsets.is_array() && offsets.size() == 2) {
        begin = json_to_u64(offsets[0]);
        end = json_to_u64(offsets[1]);
    }
    if (!begin || !end) {
        return make_error("tensor '{}': field 'data_offsets' must be [begin, end] with non-negative integers, found {}",
                          name, quote_json(offsets));
    }
    if (*begin > *end) {
        return make_error("tensor '{}': data_offsets [{}, {}] have begin > end", name, *begin, *end);
    }
    if (*end - *begin != expected_bytes) {
        return make_error("tensor '{}': {} x shape {} is {} bytes, but data_offsets [{}, {}] span {} bytes", name,
                          dtype_name(info.dtype), info.shape, expected_bytes, *begin, *end, *end - *begin);
    }
    if (*end > data_size) {
        return make_error("tensor '{}': data_offsets [{}, {}] run past the end of the data section ({} bytes)", name,
                          *begin, *end, data_size);
    }
    info.data_begin = *begin;
    info.data_end = *end;
    return info;
}

Result<std::map<std::string, std::string>> parse_metadata(const json &value) {
    if (!value.is_object()) {
        return make_error("__metadata__: expected an object of string values, found {} {}", value.type_name(),
                          quote_json(value));
    }
    std::map<std::string, std::string> metadata;
    for (const auto &[key, item] : value.items()) {
        if (!item.is_string()) {
            return make_error("__metadata__: value of '{}' must be a string, found {} {}", key, item.type_name(),
                              quote_json(item));
        }
        metadata.emplace(key, item.get<std::string>());
    }
    return metadata;
}

// The tensors, taken in data order, must tile [0, data_size) exactly: no overlap, no hole, no
// trailing bytes (the reference reader's rule). Empty tensors may sit at any tensor boundary.
Result<void> check_layout(const std::vector<TensorInfo> &tensors, uint64_t data_size) {
    std::vector<const TensorInfo *> order;
    order.reserve(tensors.size());
    for (const TensorInfo &t : tensors) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const TensorInfo *a, const TensorInfo *b) {
        if (a->data_begin != b->data_begin) return a->data_begin < b->data_begin;
        if (a->data_end != b->data_end) return a->data_end < b->data_end;
        return a->name < b->name;
    });
    uint64_t covered = 0;  // the data section is tiled up to here
    const TensorInfo *last = nullptr;
    for (const TensorInfo *t : order) {
        if (t->data_begin < covered) {
            return make_error("tensors '{}' (data_offsets [{}, {}]) and '{}' (data_offsets [{}, {}]) overlap",
                              last->name, last->data_begin, last->data_end, t->name, t->data_begin, t->data_end);
        }
        if (t->data_begin > covered) {
            return make_error("bytes [{}, {}) of the data section belong to no tensor (hole before tensor '{}'); "
                              "the data section must be fully covered",
                              covered, t->data_begin, t->name);
        }
        covered = t->data_end;
        last = t;
    }
    if (covered != data_size) {
        return make_error("{} trailing bytes after the last tensor's data (the data section is {} bytes, tensors "
                          "cover {}); the data section must be fully covered",
                          data_size - covered, data_size, covered);
    }
    return {};
}

}  // namespace

uint64_t TensorInfo::n_elements() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
}

Result<SafetensorsHeader> parse_safetensors(std::span<const std::byte> file_bytes) {
    if (file_bytes.size() < kLengthFieldBytes) {
        return make_error("file is {} bytes, too short for the 8-byte header length", file_bytes.size());
    }
    SafetensorsHeader header;
    header.header_len = read_le64(file_bytes.data());
    const uint64_t after_length = file_bytes.size() - kLengthFieldBytes;
    if (header.header_len > kMaxHeaderBytes) {
        return make_error("header length {} exceeds the limit of {} bytes", header.header_len, kMaxHeaderBytes);
    }
    if (header.header_len > after_length) {
        return make_error("header length {} runs past the end of the file ({} bytes follow the length field)",
                          header.header_len, after_length);
    }
    const uint64_t data_size = after_length - header.header_len;
    std::string_view text(reinterpret_cast<const char *>(file_bytes.data() + kLengthFieldBytes), header.header_len);

    Result<json> root = parse_json_strict(text);
    if (!root) return wrap_error("header", root.error());
    if (!root->is_object()) {
        return make_error("header: expected a JSON object, found {} {}", root->type_name(), quote_json(*root));
    }
    // nlohmann objects iterate in key order, so tensors come out sorted by name.
    for (const auto &[key, value] : root->items()) {
        if (key == "__metadata__") {
            Result<std::map<std::string, std::string>> metadata = parse_metadata(value);
            if (!metadata) return tl::unexpected(metadata.error());
            header.metadata = std::move(*metadata);
            continue;
        }
        Result<TensorInfo> info = parse_tensor_entry(key, value, data_size);
        if (!info) return tl::unexpected(info.error());
        header.tensors.push_back(std::move(*info));
    }
    Result<void> layout = check_layout(header.tensors, data_size);
    if (!layout) return tl::unexpected(layout.error());
    return header;
}

// ---- MappedFile ----

Result<MappedFile> MappedFile::open(const std::filesystem::path &path) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below as not a file.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return make_error("{}: cannot open: {}", path.string(), errno_message(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int err = errno;
        ::close(fd);
        return make_error("{}: cannot stat: {}", path.string(), errno_message(err));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        return make_error("{}: expected a regular file, found {}", path.string(),
                          S_ISDIR(st.st_mode) ? "a directory" : "a special file");
    }
    MappedFile file;
    file.path_ = path;
    // mmap refuses a zero length; an empty file is an empty span (and fails validation later).
    if (st.st_size > 0) {
        const auto size = static_cast<size_t>(st.st_size);
        void *p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
        const int err = errno;
        ::close(fd);
        if (p == MAP_FAILED) return make_error("{}: cannot map {} bytes: {}", path.string(), size, errno_message(err));
        file.data_ = static_cast<const std::byte *>(p);
        file.size_ = size;
    } else {
        ::close(fd);
    }
    return file;
}

MappedFile::MappedFile(MappedFile &&other) noexcept
    : path_(std::move(other.path_)), data_(other.data_), size_(other.size_) {
    other.data_ = nullptr;
    other.size_ = 0;
}

MappedFile &MappedFile::operator=(MappedFile &&other) noexcept {
    if (this != &other) {
        if (data_ != nullptr) ::munmap(const_cast<std::byte *>(data_), size_);
        path_ = std::move(other.path_);
        data_ = other.data_;
        size_ = other.size_;
        other.data_ = nullptr;
        other.size_ = 0;
    }
    return *this;
}

MappedFile::~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<std::byte *>(data_), size_);
}

// ---- SafetensorsFile ----

Result<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path &path) {
    Result<MappedFile> mapped = MappedFile::open(path);
    if (!mapped) return tl::unexpected(mapped.error());
    Result<SafetensorsHeader> header = parse_safetensors(mapped->bytes());
    if (!header) return wrap_error(path.string(), header.error());
    SafetensorsFile file;
    file.file_ = std::move(*mapped);
    file.header_ = std::move(*header);
    file.data_offset_ = kLengthFieldBytes + file.header_.header_len;
    return file;
}

const TensorInfo *SafetensorsFile::find(std::string_view name) const {
    const std::vector<TensorInfo> &ts = header_.tensors;
    auto it = std::lower_bound(ts.begin(), ts.end(), name,
                               [](const TensorInfo &t, std::string_view n) { return t.name < n; });
    return it != ts.end() && it->name == name ? &*it : nullptr;
}

TensorRef SafetensorsFile::ref(const TensorInfo &info) const {
    const std::vector<TensorInfo> &ts = header_.tensors;
    MEMRA_CHECK(!ts.empty() && &info >= ts.data() && &info < ts.data() + ts.size(),
                "tensor '{}' does not belong to {}", info.name, path().string());
    return TensorRef{&info, file_.bytes().subspan(data_offset_ + info.data_begin, info.n_bytes())};
}

}  // namespace memra::io
