// Oracle driver for tests/oracle/test_safetensors.py: writes sample files with memra's writer
// (write-sample) and prints what memra's reader sees in any file or checkpoint (dump), so the
// official `safetensors` package can be checked against both directions.
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace memra::tools {
namespace {

namespace fs = std::filesystem;
using io::TensorData;
using nlohmann::json;

constexpr uint64_t kHexDumpLimit = 4096;      // tensors up to this many bytes are dumped in full
constexpr uint64_t kSampleShardBytes = 64;    // small shards, so the sample checkpoint has many
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

struct SampleSpec {
    const char *name;
    DType dtype;
    std::vector<int64_t> shape;
};

// Mirrored by SAMPLE in tests/oracle/test_safetensors.py (same order: the index is the seed).
std::vector<SampleSpec> sample_specs() {
    return {
        {"embed.weight", DType::kBF16, {7, 5}},
        {"layers.0.attn.q_proj.weight", DType::kF8E4M3, {4, 9}},
        {"layers.0.attn.q_proj.weight_scale_inv", DType::kF32, {1, 1}},
        {"layers.0.mlp.gate.weight", DType::kF16, {3, 3}},
        {"layers.0.norm.weight", DType::kF32, {7}},
        {"layers.1.f8e5m2", DType::kF8E5M2, {5}},
        {"layers.1.f64", DType::kF64, {2, 3}},
        {"ints.i64", DType::kI64, {3}},
        {"ints.i32", DType::kI32, {2, 2}},
        {"ints.i16", DType::kI16, {5}},
        {"ints.i8", DType::kI8, {7}},
        {"uints.u64", DType::kU64, {2}},
        {"uints.u32", DType::kU32, {3}},
        {"uints.u16", DType::kU16, {3}},
        {"uints.u8", DType::kU8, {9}},
        {"mask", DType::kBool, {2, 5}},
        {"scalar.f32", DType::kF32, {}},
        {"scalar.bf16", DType::kBF16, {}},
        {"scalar.i64", DType::kI64, {}},
        {"empty.f32", DType::kF32, {0}},
        {"empty.bf16", DType::kBF16, {3, 0}},
        {"empty.u8", DType::kU8, {0, 4, 2}},
    };
}

// Byte i of sample tensor number seed (BOOL tensors hold 0 or 1).
std::vector<std::byte> sample_bytes(size_t seed, DType dtype, uint64_t n_bytes) {
    std::vector<std::byte> bytes(n_bytes);
    for (uint64_t i = 0; i < n_bytes; ++i) {
        const uint64_t v = dtype == DType::kBool ? ((seed + i) % 3 == 0 ? 1 : 0) : (seed * 131 + i * 29 + 7) & 0xFF;
        bytes[i] = static_cast<std::byte>(v);
    }
    return bytes;
}

std::vector<TensorData> sample_tensors() {
    std::vector<TensorData> tensors;
    const std::vector<SampleSpec> specs = sample_specs();
    for (size_t seed = 0; seed < specs.size(); ++seed) {
        TensorData t{specs[seed].name, specs[seed].dtype, specs[seed].shape, {}};
        uint64_t n = dtype_size(t.dtype);
        for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
        t.bytes = sample_bytes(seed, t.dtype, n);
        tensors.push_back(std::move(t));
    }
    return tensors;
}

int write_sample(const fs::path &dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
        fmt::print(stderr, "{}: cannot create the directory: {}\n", dir.string(), ec.message());
        return 1;
    }
    const std::vector<TensorData> tensors = sample_tensors();
    Result<void> ok = io::write_safetensors(dir / "single.safetensors", tensors,
                                            {{"format", "pt"}, {"producer", "memra safetensors_tool"}});
    if (ok) ok = io::write_sharded_checkpoint(dir / "sharded", tensors, kSampleShardBytes);
    if (!ok) {
        fmt::print(stderr, "{}\n", ok.error().message);
        return 1;
    }
    return 0;
}

std::string fnv1a64_hex(std::span<const std::byte> bytes) {
    uint64_t h = kFnvOffset;
    for (std::byte b : bytes) h = (h ^ std::to_integer<uint64_t>(b)) * kFnvPrime;
    return fmt::format("{:016x}", h);
}

std::string hex(std::span<const std::byte> bytes) {
    std::string s;
    s.reserve(bytes.size() * 2);
    for (std::byte b : bytes) s += fmt::format("{:02x}", std::to_integer<unsigned>(b));
    return s;
}

int dump(const fs::path &path) {
    Result<io::Checkpoint> ckpt = io::Checkpoint::open(path);
    if (!ckpt) {
        fmt::print(stderr, "{}\n", ckpt.error().message);
        return 1;
    }
    json out = json::object();
    json shards = json::array();
    json tensors = json::object();
    for (size_t s = 0; s < ckpt->n_shards(); ++s) {
        const io::SafetensorsFile &shard = ckpt->shard(s);
        const std::string file = shard.path().filename().string();
        shards.push_back(
            {{"file", file}, {"header_len", shard.header().header_len}, {"metadata", shard.header().metadata}});
        for (const io::TensorInfo &info : shard.tensors()) {
            const io::TensorRef ref = shard.ref(info);
            json t = {{"dtype", dtype_name(info.dtype)},
                      {"shape", info.shape},
                      {"shard", file},
                      {"data_offsets", json::array({info.data_begin, info.data_end})},
                      {"n_bytes", info.n_bytes()},
                      {"fnv1a64", fnv1a64_hex(ref.bytes)}};
            if (info.n_bytes() <= kHexDumpLimit) t["hex"] = hex(ref.bytes);
            tensors[info.name] = std::move(t);
        }
    }
    out["n_shards"] = ckpt->n_shards();
    out["total_bytes"] = ckpt->total_bytes();
    out["shards"] = std::move(shards);
    out["tensors"] = std::move(tensors);
    fmt::print("{}\n", out.dump(1, ' ', false, json::error_handler_t::replace));
    return 0;
}

int usage() {
    fmt::print(stderr,
               "usage: memra_safetensors_tool write-sample DIR   (DIR/single.safetensors and DIR/sharded/)\n"
               "       memra_safetensors_tool dump PATH          (a .safetensors file or a checkpoint dir)\n");
    return 2;
}

}  // namespace
}  // namespace memra::tools

int main(int argc, char **argv) {
    if (argc != 3) return memra::tools::usage();
    const std::string_view command = argv[1];
    if (command == "write-sample") return memra::tools::write_sample(argv[2]);
    if (command == "dump") return memra::tools::dump(argv[2]);
    return memra::tools::usage();
}
