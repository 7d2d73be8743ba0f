// Checkpoint: a directory of safetensors shards listed by model.safetensors.index.json, or a
// single model.safetensors. Every shard is mapped and validated, then the index and the shards
// must agree exactly (each tensor in the shard the index names, and nowhere else).
#include <algorithm>
#include <set>
#include <system_error>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "io/strict_json.h"

namespace memra::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kSingleFileName[] = "model.safetensors";

// A shard name from the index must name a file inside the checkpoint directory itself.
Result<void> check_shard_name(const std::string &shard) {
    if (shard.empty() || shard == "." || shard == "..") {
        return make_error("shard file name '{}' is not a file name", shard);
    }
    if (shard.find_first_of(std::string_view("/\\\0", 3)) != std::string::npos) {
        return make_error("shard file name '{}' contains a path separator; shards must sit in the checkpoint "
                          "directory",
                          shard);
    }
    return {};
}

// weight_map of the index: tensor name -> shard file name, validated.
Result<std::map<std::string, std::string>> read_weight_map(const fs::path &index_path) {
    Result<MappedFile> index_file = MappedFile::open(index_path);
    if (!index_file) return tl::unexpected(index_file.error());
    std::span<const std::byte> bytes = index_file->bytes();
    if (bytes.size() > kMaxHeaderBytes) {
        return make_error("{}: index is {} bytes, over the limit of {} bytes", index_path.string(), bytes.size(),
                          kMaxHeaderBytes);
    }
    Result<json> root = parse_json_strict({reinterpret_cast<const char *>(bytes.data()), bytes.size()});
    if (!root) return wrap_error(index_path.string(), root.error());
    if (!root->is_object()) {
        return make_error("{}: expected a JSON object, found {}", index_path.string(), root->type_name());
    }
    auto weight_map = root->find("weight_map");
    if (weight_map == root->end()) return make_error("{}: missing 'weight_map'", index_path.string());
    if (!weight_map->is_object()) {
        return make_error("{}: 'weight_map' must be an object of tensor name -> shard file name, found {}",
                          index_path.string(), weight_map->type_name());
    }
    if (weight_map->empty()) return make_error("{}: 'weight_map' lists no tensors", index_path.string());
    // HF writes metadata.total_size; it is not checked against the data because exporters
    // disagree on what it counts, but a present field must have the documented types.
    auto metadata = root->find("metadata");
    if (metadata != root->end()) {
        if (!metadata->is_object()) {
            return make_error("{}: 'metadata' must be an object, found {}", index_path.string(), metadata->type_name());
        }
        auto total = metadata->find("total_size");
        if (total != metadata->end() && !total->is_number_unsigned()) {
            return make_error("{}: 'metadata.total_size' must be a non-negative integer, found {}",
                              index_path.string(), total->type_name());
        }
    }
    std::map<std::string, std::string> result;
    for (const auto &[name, shard] : weight_map->items()) {
        if (!shard.is_string()) {
            return make_error("{}: weight_map entry for tensor '{}' must be a shard file name (string), found {}",
                              index_path.string(), name, shard.type_name());
        }
        const std::string &shard_name = shard.get_ref<const std::string &>();
        Result<void> ok = check_shard_name(shard_name);
        if (!ok) return make_error("{}: tensor '{}': {}", index_path.string(), name, ok.error().message);
        result.emplace(name, shard_name);
    }
    return result;
}

}  // namespace

Result<Checkpoint> Checkpoint::open(const std::filesystem::path &dir_or_file, const ShardProgress &progress) {
    std::error_code ec;
    const fs::file_status status = fs::status(dir_or_file, ec);
    if (!fs::exists(status)) {
        return make_error("{}: no such file or directory", dir_or_file.string());
    }
    fs::path dir;
    fs::path index_path;   // set when the checkpoint is sharded
    fs::path single_path;  // set when it is one file
    if (fs::is_directory(status)) {
        dir = dir_or_file;
        const bool has_index = fs::exists(dir / kIndexFileName, ec);
        const bool has_single = fs::exists(dir / kSingleFileName, ec);
        if (has_index && has_single) {
            return make_error("{}: both {} and {} are present; which one is the checkpoint is ambiguous, remove one",
                              dir.string(), kIndexFileName, kSingleFileName);
        }
        if (has_index) {
            index_path = dir / kIndexFileName;
        } else if (has_single) {
            single_path = dir / kSingleFileName;
        } else {
            return make_error("{}: neither {} nor {} found", dir.string(), kIndexFileName, kSingleFileName);
        }
    } else {
        dir = dir_or_file.parent_path().empty() ? fs::path(".") : dir_or_file.parent_path();
        if (dir_or_file.filename() == kIndexFileName) {
            index_path = dir_or_file;
        } else if (dir_or_file.extension() == ".safetensors") {
            single_path = dir_or_file;
        } else {
            return make_error("{}: expected a checkpoint directory, a .safetensors file or {}", dir_or_file.string(),
                              kIndexFileName);
        }
    }

    Checkpoint ckpt;
    ckpt.root_ = dir;
    if (!single_path.empty()) {
        Result<SafetensorsFile> file = SafetensorsFile::open(single_path);
        if (!file) return tl::unexpected(file.error());
        ckpt.shards_.push_back(std::make_unique<SafetensorsFile>(std::move(*file)));
        for (const TensorInfo &t : ckpt.shards_[0]->tensors()) ckpt.by_name_.emplace(t.name, Entry{0, &t});
        if (progress) progress(1, 1, single_path);
        return ckpt;
    }

    Result<std::map<std::string, std::string>> weight_map = read_weight_map(index_path);
    if (!weight_map) return tl::unexpected(weight_map.error());
    // Shards in file-name order (model-00001-of-N first); first_tensor names a tensor per shard
    // for the message when the file is missing.
    std::map<std::string, std::string> first_tensor;
    for (const auto &[name, shard] : *weight_map) first_tensor.emplace(shard, name);
    std::map<std::string, size_t> shard_index;
    for (const auto &[shard, name] : first_tensor) {
        const fs::path shard_path = dir / shard;
        if (!fs::exists(shard_path, ec)) {
            return make_error("{}: shard listed in {} (for tensor '{}' among others) does not exist",
                              shard_path.string(), kIndexFileName, name);
        }
        Result<SafetensorsFile> file = SafetensorsFile::open(shard_path);
        if (!file) return tl::unexpected(file.error());
        shard_index.emplace(shard, ckpt.shards_.size());
        ckpt.shards_.push_back(std::make_unique<SafetensorsFile>(std::move(*file)));
        if (progress) progress(ckpt.shards_.size(), first_tensor.size(), shard_path);
    }

    // Where each tensor actually is: a second shard holding it is an error on its own.
    for (size_t s = 0; s < ckpt.shards_.size(); ++s) {
        for (const TensorInfo &t : ckpt.shards_[s]->tensors()) {
            auto [it, inserted] = ckpt.by_name_.emplace(t.name, Entry{s, &t});
            if (!inserted) {
                return make_error("{}: tensor '{}' is also in shard {}; a tensor must be in exactly one shard",
                                  ckpt.shards_[s]->path().string(), t.name,
                                  ckpt.shards_[it->second.shard]->path().filename().string());
            }
        }
    }
    for (const auto &[name, shard] : *weight_map) {
        const size_t listed = shard_index.at(shard);
        auto it = ckpt.by_name_.find(name);
        if (it == ckpt.by_name_.end()) {
            return make_error("{}: tensor '{}' is listed for this shard in {} but missing from it",
                              ckpt.shards_[listed]->path().string(), name, kIndexFileName);
        }
        if (it->second.shard != listed) {
            return make_error("{}: tensor '{}' is listed for this shard in {} but missing from it (it is in {})",
                              ckpt.shards_[listed]->path().string(), name, kIndexFileName,
                              ckpt.shards_[it->second.shard]->path().filename().string());
        }
    }
    for (const auto &[name, entry] : ckpt.by_name_) {
        if (!weight_map->contains(name)) {
            return make_error("{}: tensor '{}' is in this shard but not listed in {}",
                              ckpt.shards_[entry.shard]->path().string(), name, kIndexFileName);
        }
    }
    return ckpt;
}

std::vector<std::string> Checkpoint::names() const {
    std::vector<std::string> names;
    names.reserve(by_name_.size());
    for (const auto &[name, entry] : by_name_) names.push_back(name);
    return names;
}

const TensorInfo *Checkpoint::find(std::string_view name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second.info;
}

Result<TensorRef> Checkpoint::get(std::string_view name) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return make_error("{}: tensor '{}' not found in the checkpoint", root_.string(), name);
    return shards_[it->second.shard]->ref(*it->second.info);
}

uint64_t Checkpoint::total_bytes() const {
    uint64_t total = 0;
    for (const auto &[name, entry] : by_name_) total += entry.info->n_bytes();
    return total;
}

}  // namespace memra::io
