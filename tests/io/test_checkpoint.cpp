// Tests of checkpoints: sharded round trips with the exact index text, single-file checkpoints,
// every checkpoint-level error (index, shard names, missing or misplaced tensors) and the
// sharded writer's refusals and clean-up.
#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "io/safetensors_test_util.h"

namespace memra::io {
namespace {

using namespace memra::io::testing;

struct ProgressCall {
    size_t done;
    size_t total;
    fs::path path;
};

class CheckpointTest : public ::testing::Test {
protected:
    TempDir dir_;

    // Writes a shard named name holding one small U8 tensor per name in tensors.
    void write_shard(const std::string &name, const std::vector<std::string> &tensors) {
        std::vector<TensorData> data;
        uint32_t seed = 0;
        for (const std::string &t : tensors) data.push_back(make_tensor(t, DType::kU8, {2}, seed++));
        Result<void> ok = write_safetensors(dir_ / name, data);
        ASSERT_TRUE(ok.has_value()) << ok.error().message;
    }
    void write_index(std::string_view text) { write_text(dir_ / kIndexFileName, text); }
    std::string index_path() const { return (dir_ / kIndexFileName).string(); }

    std::string open_error(const fs::path &path) {
        Result<Checkpoint> c = Checkpoint::open(path);
        EXPECT_FALSE(c.has_value()) << "accepted a bad checkpoint";
        return c.has_value() ? std::string() : c.error().message;
    }
    std::string open_error() { return open_error(dir_.path()); }
};

std::vector<TensorData> sample_tensors() {
    std::vector<TensorData> t;
    t.push_back(make_tensor("model.embed.weight", DType::kBF16, {16, 8}, 1));     // 256 bytes
    t.push_back(make_tensor("model.layers.0.attn.q", DType::kF8E4M3, {8, 8}, 2));  // 64
    t.push_back(make_tensor("model.layers.0.attn.q_scale", DType::kF32, {}, 3));   // 4
    t.push_back(make_tensor("model.layers.0.norm", DType::kF32, {7}, 4));          // 28
    t.push_back(make_tensor("model.layers.0.mlp.w", DType::kF16, {100}, 5));       // 200
    t.push_back(make_tensor("model.layers.1.attn.q", DType::kF8E5M2, {3, 3}, 6));  // 9
    t.push_back(make_tensor("model.layers.1.empty", DType::kI32, {0, 3}, 7));      // 0
    t.push_back(make_tensor("model.layers.1.big", DType::kU8, {600}, 8));          // 600: larger than a shard
    t.push_back(make_tensor("model.norm", DType::kF64, {5}, 9));                   // 40
    t.push_back(make_tensor("lm_head.flags", DType::kBool, {11}, 10));             // 11
    return t;
}

TEST_F(CheckpointTest, ShardedRoundTrip) {
    const std::vector<TensorData> tensors = sample_tensors();
    ASSERT_TRUE(write_sharded_checkpoint(dir_.path(), tensors, 300).has_value());

    // Greedy packing in the given order, at most 300 data bytes per shard: 256 | 64+4+28+200 = 296 |
    // 9+0 | 600 (over the limit, alone) | 40+11.
    const std::vector<std::vector<std::string>> expected_shards = {
        {"model.embed.weight"},
        {"model.layers.0.attn.q", "model.layers.0.attn.q_scale", "model.layers.0.norm", "model.layers.0.mlp.w"},
        {"model.layers.1.attn.q", "model.layers.1.empty"},
        {"model.layers.1.big"},
        {"model.norm", "lm_head.flags"},
    };
    const size_t n = expected_shards.size();
    std::map<std::string, std::string> weight_map;
    for (size_t s = 0; s < n; ++s) {
        for (const std::string &name : expected_shards[s]) {
            weight_map[name] = fmt::format("model-0000{}-of-0000{}.safetensors", s + 1, n);
        }
    }
    uint64_t total = 0;
    for (const TensorData &t : tensors) total += t.bytes.size();
    std::string index = fmt::format("{{\n  \"metadata\": {{\n    \"total_size\": {}\n  }},\n  \"weight_map\": {{\n",
                                    total);
    size_t i = 0;
    for (const auto &[name, shard] : weight_map) {
        index += fmt::format("    \"{}\": \"{}\"{}\n", name, shard, ++i < weight_map.size() ? "," : "");
    }
    index += "  }\n}\n";
    const std::vector<std::byte> index_bytes = read_bytes(dir_ / kIndexFileName);
    EXPECT_EQ(std::string(reinterpret_cast<const char *>(index_bytes.data()), index_bytes.size()), index);

    std::vector<ProgressCall> calls;
    Result<Checkpoint> c = Checkpoint::open(
        dir_.path(), [&calls](size_t done, size_t total_shards, const fs::path &p) {
            calls.push_back({done, total_shards, p});
        });
    ASSERT_TRUE(c.has_value()) << c.error().message;
    EXPECT_EQ(c->root(), dir_.path());
    ASSERT_EQ(c->n_shards(), n);
    ASSERT_EQ(calls.size(), n);
    for (size_t s = 0; s < n; ++s) {
        EXPECT_EQ(calls[s].done, s + 1);
        EXPECT_EQ(calls[s].total, n);
        EXPECT_EQ(calls[s].path.filename(), fmt::format("model-0000{}-of-0000{}.safetensors", s + 1, n));
        EXPECT_EQ(c->shard(s).path().filename(), calls[s].path.filename());
        EXPECT_EQ(c->shard(s).tensors().size(), expected_shards[s].size());
    }
    EXPECT_EQ(c->n_tensors(), tensors.size());
    EXPECT_EQ(c->total_bytes(), total);
    std::vector<std::string> names;
    for (const TensorData &t : tensors) names.push_back(t.name);
    std::sort(names.begin(), names.end());
    EXPECT_EQ(c->names(), names);
    for (const TensorData &t : tensors) {
        SCOPED_TRACE(t.name);
        const TensorInfo *info = c->find(t.name);
        ASSERT_NE(info, nullptr);
        EXPECT_EQ(info->dtype, t.dtype);
        EXPECT_EQ(info->shape, t.shape);
        Result<TensorRef> ref = c->get(t.name);
        ASSERT_TRUE(ref.has_value()) << ref.error().message;
        EXPECT_EQ(ref->info, info);
        EXPECT_TRUE(same_bytes(ref->bytes, t.bytes));
    }
    EXPECT_EQ(c->find("nope"), nullptr);
    Result<TensorRef> missing = c->get("nope");
    ASSERT_FALSE(missing.has_value());
    EXPECT_TRUE(has_fragment(missing.error().message, "tensor 'nope' not found in the checkpoint"));

    // The same checkpoint through the index file's path.
    Result<Checkpoint> via_index = Checkpoint::open(dir_ / kIndexFileName);
    ASSERT_TRUE(via_index.has_value()) << via_index.error().message;
    EXPECT_EQ(via_index->n_shards(), n);
    EXPECT_EQ(via_index->root(), dir_.path());
}

TEST_F(CheckpointTest, ShardedWriteIsDeterministic) {
    const std::vector<TensorData> tensors = sample_tensors();
    ASSERT_TRUE(write_sharded_checkpoint(dir_ / "a", tensors, 300).has_value());
    ASSERT_TRUE(write_sharded_checkpoint(dir_ / "b", tensors, 300).has_value());
    size_t files = 0;
    for (const auto &entry : fs::directory_iterator(dir_ / "a")) {
        const fs::path other = dir_ / "b" / entry.path().filename();
        ASSERT_TRUE(fs::exists(other)) << other;
        EXPECT_TRUE(same_bytes(read_bytes(entry.path()), read_bytes(other))) << other;
        ++files;
    }
    EXPECT_EQ(files, 6u);  // 5 shards + index
}

TEST_F(CheckpointTest, OneShardStillWritesIndex) {
    ASSERT_TRUE(write_sharded_checkpoint(dir_.path(), sample_tensors(), 1u << 20).has_value());
    EXPECT_TRUE(fs::exists(dir_ / "model-00001-of-00001.safetensors"));
    EXPECT_TRUE(fs::exists(dir_ / kIndexFileName));
    Result<Checkpoint> c = Checkpoint::open(dir_.path());
    ASSERT_TRUE(c.has_value()) << c.error().message;
    EXPECT_EQ(c->n_shards(), 1u);
    EXPECT_EQ(c->n_tensors(), sample_tensors().size());
}

TEST_F(CheckpointTest, SingleFileCheckpoints) {
    const std::vector<TensorData> tensors = sample_tensors();
    ASSERT_TRUE(write_safetensors(dir_ / "model.safetensors", tensors).has_value());
    std::vector<ProgressCall> calls;
    Result<Checkpoint> c = Checkpoint::open(dir_.path(), [&calls](size_t done, size_t total, const fs::path &p) {
        calls.push_back({done, total, p});
    });
    ASSERT_TRUE(c.has_value()) << c.error().message;
    EXPECT_EQ(c->n_shards(), 1u);
    EXPECT_EQ(c->root(), dir_.path());
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0].done, 1u);
    EXPECT_EQ(calls[0].total, 1u);
    EXPECT_EQ(calls[0].path, dir_ / "model.safetensors");
    EXPECT_EQ(c->n_tensors(), tensors.size());
    for (const TensorData &t : tensors) {
        Result<TensorRef> ref = c->get(t.name);
        ASSERT_TRUE(ref.has_value()) << ref.error().message;
        EXPECT_TRUE(same_bytes(ref->bytes, t.bytes)) << t.name;
    }

    // A path to any .safetensors file is a one-shard checkpoint rooted at its directory.
    fs::create_directories(dir_ / "other");
    ASSERT_TRUE(write_safetensors(dir_ / "other" / "weights.safetensors", {tensors[0]}).has_value());
    Result<Checkpoint> file = Checkpoint::open(dir_ / "other" / "weights.safetensors");
    ASSERT_TRUE(file.has_value()) << file.error().message;
    EXPECT_EQ(file->root(), dir_ / "other");
    EXPECT_EQ(file->names(), std::vector<std::string>{tensors[0].name});
}

TEST_F(CheckpointTest, RefusesBadPaths) {
    EXPECT_TRUE(has_fragment(open_error(dir_ / "absent"), (dir_ / "absent").string() + ": no such file or directory"));
    EXPECT_TRUE(has_fragment(open_error(), dir_.path().string() +
                                               ": neither model.safetensors.index.json nor model.safetensors found"));
    write_text(dir_ / "config.json", "{}");
    EXPECT_TRUE(has_fragment(open_error(dir_ / "config.json"),
                             "config.json: expected a checkpoint directory, a .safetensors file or "
                             "model.safetensors.index.json"));
    write_shard("model.safetensors", {"a"});
    write_shard("s1.safetensors", {"a"});
    write_index(R"({"weight_map": {"a": "s1.safetensors"}})");
    EXPECT_TRUE(has_fragment(open_error(), "both model.safetensors.index.json and model.safetensors are present"));
}

TEST_F(CheckpointTest, RefusesBadIndex) {
    write_shard("s1.safetensors", {"a", "b"});
    struct Case {
        std::string index;
        std::string fragment;
    };
    const std::vector<Case> cases = {
        {"", "invalid JSON"},
        {R"({"weight_map": {"a": "s1.safetensors",})", "invalid JSON"},
        {"[1]", "expected a JSON object, found array"},
        {R"({"metadata": {}})", "missing 'weight_map'"},
        {R"({"weight_map": ["a"]})", "'weight_map' must be an object of tensor name -> shard file name, found array"},
        {R"({"weight_map": {}})", "'weight_map' lists no tensors"},
        {R"({"weight_map": {"a": "s1.safetensors", "b": 3}})",
         "weight_map entry for tensor 'b' must be a shard file name (string), found number"},
        {R"({"weight_map": {"a": "s1.safetensors", "b": null}})", "found null"},
        {R"({"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors", "b": "s1.safetensors"}})",
         "duplicate key \"a\" in \"weight_map\""},
        {R"({"metadata": 5, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})",
         "'metadata' must be an object, found number"},
        {R"({"metadata": {"total_size": -1}, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})",
         "'metadata.total_size' must be a non-negative integer, found number"},
        {R"({"metadata": {"total_size": "4"}, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})",
         "'metadata.total_size' must be a non-negative integer, found string"},
        {R"({"weight_map": {"a": "s1.safetensors", "b": "../s1.safetensors"}})",
         "tensor 'b': shard file name '../s1.safetensors' contains a path separator"},
        {R"({"weight_map": {"a": "s1.safetensors", "b": "/tmp/s1.safetensors"}})",
         "shard file name '/tmp/s1.safetensors' contains a path separator"},
        {R"({"weight_map": {"a": "s1.safetensors", "b": "sub\\s1.safetensors"}})",
         "shard file name 'sub\\s1.safetensors' contains a path separator"},
        {R"({"weight_map": {"a": "s1.safetensors", "b": ".."}})",
         "tensor 'b': shard file name '..' is not a file name"},
        {R"({"weight_map": {"a": "s1.safetensors", "b": ""}})", "tensor 'b': shard file name '' is not a file name"},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.index);
        write_index(c.index);
        const std::string msg = open_error();
        EXPECT_TRUE(has_fragment(msg, index_path() + ": "));
        EXPECT_TRUE(has_fragment(msg, c.fragment));
    }
    // The valid index for the same shard opens (so the cases above fail for their own reason).
    write_index(R"({"metadata": {"total_size": 4}, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
    Result<Checkpoint> ok = Checkpoint::open(dir_.path());
    ASSERT_TRUE(ok.has_value()) << ok.error().message;
    EXPECT_EQ(ok->n_tensors(), 2u);
}

TEST_F(CheckpointTest, RefusesMissingShard) {
    write_shard("s1.safetensors", {"a"});
    write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"}})");
    EXPECT_TRUE(has_fragment(open_error(), (dir_ / "s2.safetensors").string() +
                                               ": shard listed in model.safetensors.index.json (for tensor 'b' "
                                               "among others) does not exist"));
}

TEST_F(CheckpointTest, RefusesCorruptShard) {
    write_shard("s1.safetensors", {"a"});
    write_bytes(dir_ / "s2.safetensors", file_image("{}", {}, 1000));
    write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
    std::vector<ProgressCall> calls;
    Result<Checkpoint> c = Checkpoint::open(dir_.path(), [&calls](size_t done, size_t total, const fs::path &p) {
        calls.push_back({done, total, p});
    });
    ASSERT_FALSE(c.has_value());
    EXPECT_TRUE(has_fragment(c.error().message, (dir_ / "s2.safetensors").string() + ": header length 1000 runs past"));
    ASSERT_EQ(calls.size(), 1u);  // only the shard that validated was reported
    EXPECT_EQ(calls[0].total, 2u);
}

TEST_F(CheckpointTest, RefusesTensorMissingFromItsShard) {
    write_shard("s1.safetensors", {"a"});
    write_shard("s2.safetensors", {"b"});
    write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "z": "s2.safetensors"}})");
    EXPECT_TRUE(has_fragment(open_error(), (dir_ / "s2.safetensors").string() +
                                               ": tensor 'z' is listed for this shard in "
                                               "model.safetensors.index.json but missing from it"));
}

TEST_F(CheckpointTest, RefusesTensorInTheWrongShard) {
    write_shard("s1.safetensors", {"a", "b"});
    write_shard("s2.safetensors", {"c"});
    write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"}})");
    EXPECT_TRUE(has_fragment(open_error(), (dir_ / "s2.safetensors").string() +
                                               ": tensor 'b' is listed for this shard in model.safetensors.index.json "
                                               "but missing from it (it is in s1.safetensors)"));
}

TEST_F(CheckpointTest, RefusesTensorNotInIndex) {
    write_shard("s1.safetensors", {"a", "extra"});
    write_shard("s2.safetensors", {"b"});
    write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
    EXPECT_TRUE(has_fragment(open_error(), (dir_ / "s1.safetensors").string() +
                                               ": tensor 'extra' is in this shard but not listed in "
                                               "model.safetensors.index.json"));
}

TEST_F(CheckpointTest, RefusesTensorInTwoShards) {
    write_shard("s1.safetensors", {"a", "b"});
    write_shard("s2.safetensors", {"a", "c"});
    write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}})");
    EXPECT_TRUE(has_fragment(open_error(), (dir_ / "s2.safetensors").string() +
                                               ": tensor 'a' is also in shard s1.safetensors; a tensor must be in "
                                               "exactly one shard"));
}

TEST_F(CheckpointTest, ShardedWriterRefusals) {
    const std::vector<TensorData> tensors = sample_tensors();
    Result<void> r = write_sharded_checkpoint(dir_ / "x", tensors, 0);
    ASSERT_FALSE(r.has_value());
    EXPECT_TRUE(has_fragment(r.error().message, "max_shard_bytes must be positive"));
    r = write_sharded_checkpoint(dir_ / "x", {}, 100);
    ASSERT_FALSE(r.has_value());
    EXPECT_TRUE(has_fragment(r.error().message, "a sharded checkpoint needs at least one tensor"));
    std::vector<TensorData> dup = tensors;
    dup.push_back(tensors[3]);
    r = write_sharded_checkpoint(dir_ / "x", dup, 100);
    ASSERT_FALSE(r.has_value());
    EXPECT_TRUE(has_fragment(r.error().message, "tensor 'model.layers.0.norm' appears more than once"));
    EXPECT_TRUE(fs::is_empty(dir_.path())) << "a refused write created files";

    write_shard("model.safetensors", {"a"});
    r = write_sharded_checkpoint(dir_.path(), tensors, 100);
    ASSERT_FALSE(r.has_value());
    EXPECT_TRUE(has_fragment(r.error().message, "holds a model.safetensors"));
}

TEST_F(CheckpointTest, FailedShardedWriteRemovesItsShards) {
    // The second shard's name is taken by a non-empty directory, so its rename fails after the
    // first shard was written; the first must be removed again and no index written.
    fs::create_directories(dir_ / "model-00002-of-00005.safetensors" / "child");
    Result<void> r = write_sharded_checkpoint(dir_.path(), sample_tensors(), 300);
    ASSERT_FALSE(r.has_value());
    EXPECT_TRUE(has_fragment(r.error().message, "model-00002-of-00005.safetensors: cannot rename"));
    std::vector<std::string> left;
    for (const auto &entry : fs::directory_iterator(dir_.path())) left.push_back(entry.path().filename().string());
    EXPECT_EQ(left, std::vector<std::string>{"model-00002-of-00005.safetensors"});
}

}  // namespace
}  // namespace memra::io
