// Shared helpers for the safetensors tests: a per-test temporary directory, raw file images built
// byte by byte from a JSON header string (to make corrupted files), and deterministic tensors.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "io/safetensors.h"

namespace memra::io::testing {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, unique per process and test, removed at the end.
class TempDir {
public:
    TempDir() {
        const ::testing::TestInfo *info = ::testing::UnitTest::GetInstance()->current_test_info();
        std::random_device rd;
        path_ = fs::temp_directory_path() /
                fmt::format("memra_io_{}_{}_{}_{:08x}", ::getpid(), info ? info->test_suite_name() : "none",
                            info ? info->name() : "none", rd());
        fs::create_directories(path_);
    }
    TempDir(const TempDir &) = delete;
    TempDir &operator=(const TempDir &) = delete;
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path_, ec);
    }
    const fs::path &path() const { return path_; }
    fs::path operator/(std::string_view name) const { return path_ / name; }

private:
    fs::path path_;
};

inline void append_le64(std::vector<std::byte> &out, uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFF));
}

// A file image: the 8-byte length (header_len, or the header's size when omitted), the header
// text as given (no padding) and the data bytes.
inline std::vector<std::byte> file_image(std::string_view header, const std::vector<uint8_t> &data = {},
                                         std::optional<uint64_t> header_len = std::nullopt) {
    std::vector<std::byte> out;
    append_le64(out, header_len.value_or(header.size()));
    for (char c : header) out.push_back(static_cast<std::byte>(c));
    for (uint8_t b : data) out.push_back(static_cast<std::byte>(b));
    return out;
}

inline void write_bytes(const fs::path &path, std::span<const std::byte> bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char *>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << path;
}

inline void write_text(const fs::path &path, std::string_view text) {
    write_bytes(path, {reinterpret_cast<const std::byte *>(text.data()), text.size()});
}

inline std::vector<std::byte> read_bytes(const fs::path &path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::byte> out(chars.size());
    for (size_t i = 0; i < chars.size(); ++i) out[i] = static_cast<std::byte>(chars[i]);
    return out;
}

inline std::vector<std::byte> to_bytes(std::initializer_list<uint8_t> values) {
    std::vector<std::byte> out;
    for (uint8_t v : values) out.push_back(static_cast<std::byte>(v));
    return out;
}

// A tensor with deterministic pseudo-random bytes (0/1 for BOOL).
inline TensorData make_tensor(std::string name, DType dtype, std::vector<int64_t> shape, uint32_t seed) {
    TensorData t;
    t.name = std::move(name);
    t.dtype = dtype;
    t.shape = std::move(shape);
    uint64_t n = dtype_size(dtype);
    for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
    std::mt19937 rng(seed);
    t.bytes.resize(n);
    for (std::byte &b : t.bytes) {
        const auto r = static_cast<uint32_t>(rng());
        b = static_cast<std::byte>(dtype == DType::kBool ? (r & 1u) : (r & 0xFFu));
    }
    return t;
}

inline bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

inline ::testing::AssertionResult has_fragment(const std::string &message, std::string_view fragment) {
    if (message.find(fragment) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message \"" << message << "\" lacks \"" << fragment << "\"";
}

}  // namespace memra::io::testing
