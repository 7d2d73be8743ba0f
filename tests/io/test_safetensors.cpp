// Tests of the safetensors reader and writer: round trips of every dtype, zero-copy views, typed
// access, exact writer bytes, and one test per validation error with its distinctive message.
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "io/safetensors_test_util.h"

namespace memra::io {
namespace {

using namespace memra::io::testing;

// The header text padded with spaces to a multiple of 8, so the data section starts 8-aligned.
std::string padded(std::string header) {
    header.resize((header.size() + 7) / 8 * 8, ' ');
    return header;
}

class SafetensorsTest : public ::testing::Test {
protected:
    TempDir dir_;

    // Writes image as bad.safetensors and returns SafetensorsFile::open's error, which must name
    // the file.
    std::string open_error(std::span<const std::byte> image) {
        const fs::path path = dir_ / "bad.safetensors";
        write_bytes(path, image);
        Result<SafetensorsFile> f = SafetensorsFile::open(path);
        EXPECT_FALSE(f.has_value()) << "accepted a malformed file";
        if (f.has_value()) return {};
        EXPECT_TRUE(has_fragment(f.error().message, path.string() + ": "));
        // parse_safetensors on the same bytes fails with the same message minus the file prefix.
        Result<SafetensorsHeader> h = parse_safetensors(image);
        EXPECT_FALSE(h.has_value());
        if (!h) {
            EXPECT_EQ(path.string() + ": " + h.error().message, f.error().message);
        }
        return f.error().message;
    }
    std::string open_error(std::string_view header, const std::vector<uint8_t> &data = {}) {
        return open_error(file_image(header, data));
    }
};

template <class T>
void expect_typed_view(const TensorRef &ref, std::span<const std::byte> expected) {
    Result<std::span<const T>> view = ref.as<T>();
    ASSERT_TRUE(view.has_value()) << view.error().message;
    EXPECT_EQ(view->size(), ref.info->n_elements());
    EXPECT_EQ(static_cast<const void *>(view->data()), static_cast<const void *>(ref.bytes.data()));
    ASSERT_EQ(view->size_bytes(), expected.size());
    EXPECT_EQ(std::memcmp(view->data(), expected.data(), expected.size()), 0);
}

// ---- round trips ----

TEST_F(SafetensorsTest, RoundTripEveryDType) {
    std::vector<TensorData> tensors;
    uint32_t seed = 1;
    for (DType t : kAllDTypes) {
        tensors.push_back(make_tensor(fmt::format("w.{}", dtype_name(t)), t, {3, 5}, seed++));
        tensors.push_back(make_tensor(fmt::format("v.{}", dtype_name(t)), t, {7}, seed++));
    }
    const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "unicode \xc3\xa9 ok"}};
    const fs::path path = dir_ / "all.safetensors";
    Result<void> w = write_safetensors(path, tensors, metadata);
    ASSERT_TRUE(w.has_value()) << w.error().message;

    Result<SafetensorsFile> f = SafetensorsFile::open(path);
    ASSERT_TRUE(f.has_value()) << f.error().message;
    EXPECT_EQ(f->path(), path);
    EXPECT_EQ(f->file_size(), fs::file_size(path));
    EXPECT_EQ(f->header().metadata, metadata);
    ASSERT_EQ(f->tensors().size(), tensors.size());
    EXPECT_TRUE(std::is_sorted(f->tensors().begin(), f->tensors().end(),
                               [](const TensorInfo &a, const TensorInfo &b) { return a.name < b.name; }));
    for (const TensorData &t : tensors) {
        SCOPED_TRACE(t.name);
        const TensorInfo *info = f->find(t.name);
        ASSERT_NE(info, nullptr);
        EXPECT_EQ(info->name, t.name);
        EXPECT_EQ(info->dtype, t.dtype);
        EXPECT_EQ(info->shape, t.shape);
        EXPECT_EQ(info->n_bytes(), t.bytes.size());
        const TensorRef ref = f->ref(*info);
        EXPECT_EQ(ref.info, info);
        EXPECT_TRUE(same_bytes(ref.bytes, t.bytes));
        switch (dtype_size(t.dtype)) {
        case 1: expect_typed_view<uint8_t>(ref, t.bytes); break;
        case 2: expect_typed_view<uint16_t>(ref, t.bytes); break;
        case 4: expect_typed_view<uint32_t>(ref, t.bytes); break;
        case 8: expect_typed_view<uint64_t>(ref, t.bytes); break;
        default: FAIL() << "unexpected dtype size";
        }
    }
    EXPECT_EQ(f->find("absent"), nullptr);
    EXPECT_EQ(f->find(""), nullptr);
}

TEST_F(SafetensorsTest, ScalarAndZeroSizedTensors) {
    std::vector<TensorData> tensors = {
        make_tensor("scalar_f32", DType::kF32, {}, 1), make_tensor("scalar_bf16", DType::kBF16, {}, 2),
        make_tensor("empty", DType::kF16, {0}, 3),     make_tensor("empty_2d", DType::kI64, {4, 0}, 4),
        make_tensor("empty_3d", DType::kU8, {0, 0, 9}, 5),
    };
    const fs::path path = dir_ / "edge.safetensors";
    ASSERT_TRUE(write_safetensors(path, tensors).has_value());
    Result<SafetensorsFile> f = SafetensorsFile::open(path);
    ASSERT_TRUE(f.has_value()) << f.error().message;
    const TensorInfo *scalar = f->find("scalar_f32");
    ASSERT_NE(scalar, nullptr);
    EXPECT_TRUE(scalar->shape.empty());
    EXPECT_EQ(scalar->n_elements(), 1u);
    EXPECT_EQ(scalar->n_bytes(), 4u);
    EXPECT_TRUE(same_bytes(f->ref(*scalar).bytes, tensors[0].bytes));
    Result<std::span<const float>> scalar_view = f->ref(*scalar).as<float>();
    ASSERT_TRUE(scalar_view.has_value()) << scalar_view.error().message;
    EXPECT_EQ(scalar_view->size(), 1u);
    for (const char *name : {"empty", "empty_2d", "empty_3d"}) {
        const TensorInfo *info = f->find(name);
        ASSERT_NE(info, nullptr) << name;
        EXPECT_EQ(info->n_elements(), 0u) << name;
        EXPECT_EQ(info->n_bytes(), 0u) << name;
        EXPECT_TRUE(f->ref(*info).bytes.empty()) << name;
    }
    EXPECT_EQ(f->find("empty_2d")->shape, (std::vector<int64_t>{4, 0}));
}

TEST_F(SafetensorsTest, EmptyHeaderAndNoTensors) {
    const fs::path path = dir_ / "none.safetensors";
    ASSERT_TRUE(write_safetensors(path, {}).has_value());
    // {} padded to 8 bytes, nothing else.
    EXPECT_TRUE(same_bytes(read_bytes(path), file_image("{}      ")));
    Result<SafetensorsFile> f = SafetensorsFile::open(path);
    ASSERT_TRUE(f.has_value()) << f.error().message;
    EXPECT_TRUE(f->tensors().empty());
    EXPECT_EQ(f->header().header_len, 8u);
}

// ---- zero copy and typed access ----

// The [start, end) address range of the mapping of file in this process, from /proc/self/maps.
std::pair<uintptr_t, uintptr_t> mapping_of(const fs::path &file) {
    const std::string target = fs::canonical(file).string();
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
        std::istringstream fields(line);
        std::string range, perms, offset, dev, inode, name;
        fields >> range >> perms >> offset >> dev >> inode >> name;
        if (name != target) continue;
        const size_t dash = range.find('-');
        return {std::stoull(range.substr(0, dash), nullptr, 16), std::stoull(range.substr(dash + 1), nullptr, 16)};
    }
    return {0, 0};
}

TEST_F(SafetensorsTest, ViewsPointInsideTheMapping) {
    const std::vector<TensorData> tensors = {make_tensor("a", DType::kF32, {64, 3}, 1),
                                             make_tensor("b", DType::kBF16, {5}, 2)};
    const fs::path path = dir_ / "z.safetensors";
    ASSERT_TRUE(write_safetensors(path, tensors).has_value());
    Result<SafetensorsFile> f = SafetensorsFile::open(path);
    ASSERT_TRUE(f.has_value()) << f.error().message;
    const auto [start, end] = mapping_of(path);
    ASSERT_NE(start, 0u) << "no mapping of " << path << " in /proc/self/maps";
    for (const TensorInfo &info : f->tensors()) {
        const TensorRef ref = f->ref(info);
        const auto addr = reinterpret_cast<uintptr_t>(ref.bytes.data());
        EXPECT_GE(addr, start);
        EXPECT_LE(addr + ref.bytes.size(), end);
        // The mapping starts at file offset 0: the view is at 8 + header_len + data_begin.
        EXPECT_EQ(addr - start, 8 + f->header().header_len + info.data_begin);
    }
    // The same view twice is the same memory (no copy).
    EXPECT_EQ(f->ref(*f->find("a")).bytes.data(), f->ref(*f->find("a")).bytes.data());
}

TEST_F(SafetensorsTest, TypedViewChecksElementSize) {
    const fs::path path = dir_ / "t.safetensors";
    TensorData t{"w", DType::kF32, {2}, {}};
    const float values[2] = {1.5f, -2.25f};
    t.bytes.resize(sizeof values);
    std::memcpy(t.bytes.data(), values, sizeof values);
    ASSERT_TRUE(write_safetensors(path, {t}).has_value());
    Result<SafetensorsFile> f = SafetensorsFile::open(path);
    ASSERT_TRUE(f.has_value()) << f.error().message;
    const TensorRef ref = f->ref(f->tensors()[0]);
    Result<std::span<const float>> ok = ref.as<float>();
    ASSERT_TRUE(ok.has_value()) << ok.error().message;
    ASSERT_EQ(ok->size(), 2u);
    EXPECT_EQ((*ok)[0], 1.5f);
    EXPECT_EQ((*ok)[1], -2.25f);
    Result<std::span<const uint16_t>> small = ref.as<uint16_t>();
    ASSERT_FALSE(small.has_value());
    EXPECT_TRUE(has_fragment(small.error().message, "tensor w: element size 2 requested, dtype F32 has 4"));
    Result<std::span<const double>> big = ref.as<double>();
    ASSERT_FALSE(big.has_value());
    EXPECT_TRUE(has_fragment(big.error().message, "element size 8 requested, dtype F32 has 4"));
}

TEST_F(SafetensorsTest, TypedViewChecksAlignment) {
    // A hand-made (valid) file whose F32 tensor starts at data offset 1.
    const std::string header =
        padded(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"F32","shape":[1],)"
               R"("data_offsets":[1,5]}})");
    const fs::path path = dir_ / "mis.safetensors";
    write_bytes(path, file_image(header, {7, 0, 0, 0x80, 0x3f}));
    Result<SafetensorsFile> f = SafetensorsFile::open(path);
    ASSERT_TRUE(f.has_value()) << f.error().message;
    const TensorRef ref = f->ref(*f->find("b"));
    Result<std::span<const float>> view = ref.as<float>();
    ASSERT_FALSE(view.has_value());
    EXPECT_TRUE(has_fragment(view.error().message, "tensor b: data is not 4-byte aligned in the file"));
    // Its bytes are still reachable.
    EXPECT_TRUE(same_bytes(ref.bytes, to_bytes({0, 0, 0x80, 0x3f})));
    Result<std::span<const uint8_t>> a = f->ref(*f->find("a")).as<uint8_t>();
    ASSERT_TRUE(a.has_value());
    EXPECT_EQ((*a)[0], 7);
}

// ---- MappedFile ----

TEST_F(SafetensorsTest, MappedFileMapsAndMoves) {
    const fs::path path = dir_ / "blob";
    write_bytes(path, to_bytes({1, 2, 3, 4, 5}));
    Result<MappedFile> m = MappedFile::open(path);
    ASSERT_TRUE(m.has_value()) << m.error().message;
    EXPECT_TRUE(same_bytes(m->bytes(), to_bytes({1, 2, 3, 4, 5})));
    EXPECT_EQ(m->path(), path);
    const std::byte *data = m->bytes().data();
    MappedFile moved(std::move(*m));
    EXPECT_EQ(moved.bytes().data(), data);
    EXPECT_TRUE(m->bytes().empty());
    MappedFile assigned;
    assigned = std::move(moved);
    EXPECT_EQ(assigned.bytes().data(), data);
    EXPECT_EQ(assigned.bytes().size(), 5u);
    EXPECT_TRUE(moved.bytes().empty());
}

TEST_F(SafetensorsTest, MappedFileEmptyFileAndErrors) {
    const fs::path empty = dir_ / "empty";
    write_bytes(empty, {});
    Result<MappedFile> m = MappedFile::open(empty);
    ASSERT_TRUE(m.has_value()) << m.error().message;
    EXPECT_TRUE(m->bytes().empty());

    Result<MappedFile> missing = MappedFile::open(dir_ / "missing");
    ASSERT_FALSE(missing.has_value());
    EXPECT_TRUE(has_fragment(missing.error().message, "missing: cannot open: No such file or directory"));

    Result<MappedFile> directory = MappedFile::open(dir_.path());
    ASSERT_FALSE(directory.has_value());
    EXPECT_TRUE(has_fragment(directory.error().message, "expected a regular file, found a directory"));

    // A FIFO with no writer is refused at once rather than blocking the open.
    const fs::path fifo = dir_ / "fifo";
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    Result<MappedFile> special = MappedFile::open(fifo);
    ASSERT_FALSE(special.has_value());
    EXPECT_TRUE(has_fragment(special.error().message, "fifo: expected a regular file, found a special file"));
}

TEST_F(SafetensorsTest, ZeroLengthFileFailsValidation) {
    const std::string msg = open_error(std::span<const std::byte>{});
    EXPECT_TRUE(has_fragment(msg, "file is 0 bytes, too short for the 8-byte header length"));
}

// ---- writer ----

TEST_F(SafetensorsTest, WriterProducesExactBytes) {
    const std::vector<TensorData> tensors = {
        {"b", DType::kU8, {3}, to_bytes({1, 2, 3})},
        {"a", DType::kF32, {}, to_bytes({0x00, 0x00, 0x80, 0x3f})},
        {"c", DType::kI16, {0}, {}},
    };
    const fs::path path = dir_ / "g.safetensors";
    ASSERT_TRUE(write_safetensors(path, tensors, {{"k", "v"}}).has_value());
    // Keys sorted; data by alignment (c: empty -> 8, a: 4 bytes -> 4, b: 3 bytes -> 1), then name.
    const std::string json = R"({"__metadata__":{"k":"v"},"a":{"data_offsets":[0,4],"dtype":"F32","shape":[]},)"
                             R"("b":{"data_offsets":[4,7],"dtype":"U8","shape":[3]},)"
                             R"("c":{"data_offsets":[0,0],"dtype":"I16","shape":[0]}})";
    const std::string header = padded(json);
    ASSERT_EQ(header.size() % 8, 0u);
    EXPECT_TRUE(same_bytes(read_bytes(path), file_image(header, {0x00, 0x00, 0x80, 0x3f, 1, 2, 3})));
}

TEST_F(SafetensorsTest, WriterIsDeterministic) {
    std::vector<TensorData> tensors;
    for (int i = 0; i < 12; ++i) {
        tensors.push_back(make_tensor(fmt::format("layer.{}.w", i), kAllDTypes[i % 15], {i + 1, 3}, 100u + i));
    }
    const fs::path first = dir_ / "1.safetensors";
    const fs::path second = dir_ / "2.safetensors";
    ASSERT_TRUE(write_safetensors(first, tensors, {{"a", "1"}}).has_value());
    std::reverse(tensors.begin(), tensors.end());  // input order must not matter
    ASSERT_TRUE(write_safetensors(second, tensors, {{"a", "1"}}).has_value());
    const std::vector<std::byte> a = read_bytes(first);
    EXPECT_FALSE(a.empty());
    EXPECT_TRUE(same_bytes(a, read_bytes(second)));
    // Overwriting an existing file replaces it.
    ASSERT_TRUE(write_safetensors(second, {tensors[0]}).has_value());
    EXPECT_FALSE(same_bytes(a, read_bytes(second)));
    Result<SafetensorsFile> f = SafetensorsFile::open(second);
    ASSERT_TRUE(f.has_value()) << f.error().message;
    EXPECT_EQ(f->tensors().size(), 1u);
}

TEST_F(SafetensorsTest, WriterAlignsWithoutHoles) {
    std::vector<TensorData> tensors;
    uint32_t seed = 0;
    for (DType t : kAllDTypes) {
        for (int64_t n : {1, 2, 3, 5, 8, 17}) {
            tensors.push_back(make_tensor(fmt::format("{}.{}", dtype_name(t), n), t, {n}, seed++));
        }
    }
    const fs::path path = dir_ / "align.safetensors";
    ASSERT_TRUE(write_safetensors(path, tensors).has_value());
    // The reader demands a hole-free data section, so opening proves there is no padding.
    Result<SafetensorsFile> f = SafetensorsFile::open(path);
    ASSERT_TRUE(f.has_value()) << f.error().message;
    EXPECT_EQ(f->header().header_len % 8, 0u);
    for (const TensorInfo &info : f->tensors()) {
        EXPECT_EQ(info.data_begin % dtype_size(info.dtype), 0u) << info.name;
        if (info.n_bytes() % 8 == 0) {
            EXPECT_EQ(info.data_begin % 8, 0u) << info.name;
        }
        EXPECT_EQ(reinterpret_cast<uintptr_t>(f->ref(info).bytes.data()) % dtype_size(info.dtype), 0u) << info.name;
    }
}

TEST_F(SafetensorsTest, WriterRefusesBadTensors) {
    struct Case {
        std::vector<TensorData> tensors;
        std::string fragment;
    };
    const std::vector<Case> cases = {
        {{{"a", DType::kU8, {1}, to_bytes({1})}, {"a", DType::kU8, {1}, to_bytes({2})}},
         "tensor 'a' appears more than once"},
        {{{"a", DType::kF32, {2}, to_bytes({1, 2, 3, 4, 5, 6, 7})}},
         "tensor 'a': F32 x shape [2] needs 8 bytes, found 7"},
        {{{"a", DType::kU8, {2, -1}, {}}}, "tensor 'a': shape[1] is -1, expected a non-negative dimension"},
        {{{"a", DType::kU8, {int64_t{1} << 40, int64_t{1} << 40}, {}}}, "has more elements than fit in 64 bits"},
        {{{"a", DType::kF64, {int64_t{1} << 62}, {}}}, "needs more than 2^64 bytes"},
        {{{"__metadata__", DType::kU8, {}, to_bytes({1})}}, "tensor name '__metadata__' is reserved"},
        {{{"bad\xff", DType::kU8, {}, to_bytes({1})}}, "is not valid UTF-8"},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.fragment);
        const fs::path path = dir_ / "w.safetensors";
        Result<void> r = write_safetensors(path, c.tensors);
        ASSERT_FALSE(r.has_value());
        EXPECT_TRUE(has_fragment(r.error().message, path.string() + ": "));
        EXPECT_TRUE(has_fragment(r.error().message, c.fragment));
        EXPECT_TRUE(fs::is_empty(dir_.path())) << "a refused write left a file";
    }
    Result<void> meta = write_safetensors(dir_ / "m.safetensors", {}, {{"k", "\xc3"}});
    ASSERT_FALSE(meta.has_value());
    EXPECT_TRUE(has_fragment(meta.error().message, "metadata entry 'k' is not valid UTF-8"));
    EXPECT_TRUE(fs::is_empty(dir_.path()));
}

TEST_F(SafetensorsTest, FailedWriteLeavesNoFile) {
    const std::vector<TensorData> tensors = {make_tensor("a", DType::kF32, {4}, 1)};
    // The parent directory does not exist: the temporary file cannot be created.
    Result<void> r = write_safetensors(dir_ / "no_such_dir" / "x.safetensors", tensors);
    ASSERT_FALSE(r.has_value());
    EXPECT_TRUE(has_fragment(r.error().message, "cannot create a temporary file"));
    EXPECT_TRUE(fs::is_empty(dir_.path()));
    // The target is a non-empty directory: everything is written, then the rename fails and the
    // temporary file must be removed.
    const fs::path target = dir_ / "occupied.safetensors";
    fs::create_directories(target / "child");
    r = write_safetensors(target, tensors);
    ASSERT_FALSE(r.has_value());
    EXPECT_TRUE(has_fragment(r.error().message, "cannot rename the temporary file into place"));
    size_t entries = 0;
    for (const auto &entry : fs::directory_iterator(dir_.path())) {
        EXPECT_EQ(entry.path().filename(), "occupied.safetensors");
        ++entries;
    }
    EXPECT_EQ(entries, 1u);
}

// ---- validation errors, one per case ----

TEST_F(SafetensorsTest, RefusesBadLengthField) {
    std::vector<std::byte> seven(7, std::byte{0});
    EXPECT_TRUE(has_fragment(open_error(seven), "file is 7 bytes, too short for the 8-byte header length"));
    EXPECT_TRUE(has_fragment(open_error(file_image("{}", {}, kMaxHeaderBytes + 1)),
                             "header length 100000001 exceeds the limit of 100000000 bytes"));
    EXPECT_TRUE(has_fragment(open_error(file_image("{}", {}, UINT64_MAX)),
                             "header length 18446744073709551615 exceeds the limit"));
    EXPECT_TRUE(has_fragment(open_error(file_image("{\"a\": 1}", {}, 100)),
                             "header length 100 runs past the end of the file (8 bytes follow the length field)"));
    EXPECT_TRUE(has_fragment(open_error(file_image("", {}, 0)), "header: invalid JSON"));
}

TEST_F(SafetensorsTest, RefusesMalformedHeaders) {
    struct Case {
        std::string header;
        std::vector<uint8_t> data;
        std::string fragment;
    };
    // e(...) makes one tensor entry.
    auto e = [](std::string_view dtype, std::string_view shape, std::string_view offsets) {
        return fmt::format(R"({{"dtype":{},"shape":{},"data_offsets":{}}})", dtype, shape, offsets);
    };
    std::string deep = R"({"__metadata__":)";
    for (int i = 0; i < 200; ++i) deep += '[';
    for (int i = 0; i < 200; ++i) deep += ']';
    deep += '}';
    const std::vector<Case> cases = {
        {"[]", {}, "header: expected a JSON object, found array"},
        {"\"x\"", {}, "header: expected a JSON object, found string"},
        {R"({"a":)", {}, "header: invalid JSON: parse error at line 1, column 6"},
        {"{\"a\xff\":1}", {}, "header: invalid JSON"},
        {"{} x", {}, "header: invalid JSON"},
        {deep, {}, "header: JSON nesting deeper than 128 levels"},
        {R"({"a":3})", {}, "tensor 'a': expected an object with dtype, shape and data_offsets, found number 3"},
        {R"({"a":null})", {}, "tensor 'a': expected an object with dtype, shape and data_offsets, found null"},
        {R"({"a":{"shape":[1],"data_offsets":[0,1]}})", {1}, "tensor 'a': missing field 'dtype'"},
        {R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", {1}, "tensor 'a': missing field 'shape'"},
        {R"({"a":{"dtype":"U8","shape":[1]}})", {1}, "tensor 'a': missing field 'data_offsets'"},
        {R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"foo":1}})", {1},
         "tensor 'a': unexpected field 'foo'"},
        {"{\"a\":" + e("4", "[1]", "[0,1]") + "}", {1}, "tensor 'a': field 'dtype' must be a string, found number 4"},
        {"{\"a\":" + e("\"F4\"", "[1]", "[0,1]") + "}", {1}, "tensor 'a': unknown dtype 'F4' (known: F64, F32"},
        {"{\"a\":" + e("\"f32\"", "[1]", "[0,4]") + "}", {1, 2, 3, 4}, "unknown dtype 'f32'"},
        {"{\"a\":" + e("\"U8\"", "\"1\"", "[0,1]") + "}", {1},
         "tensor 'a': field 'shape' must be an array of non-negative integers, found string \"1\""},
        {"{\"a\":" + e("\"U8\"", "[1,-1]", "[0,0]") + "}", {},
         "tensor 'a': shape[1] is -1, expected a non-negative integer"},
        {"{\"a\":" + e("\"U8\"", "[1.5]", "[0,1]") + "}", {1}, "tensor 'a': shape[0] is 1.5, expected a non-negative"},
        {"{\"a\":" + e("\"U8\"", "[2.0]", "[0,2]") + "}", {1, 2}, "tensor 'a': shape[0] is 2.0, expected"},
        {"{\"a\":" + e("\"U8\"", "[1e3]", "[0,1000]") + "}", {}, "tensor 'a': shape[0] is 1000.0, expected"},
        {"{\"a\":" + e("\"U8\"", "[\"2\"]", "[0,2]") + "}", {1, 2}, "tensor 'a': shape[0] is \"2\", expected"},
        {"{\"a\":" + e("\"U8\"", "[null]", "[0,0]") + "}", {}, "tensor 'a': shape[0] is null, expected"},
        {"{\"a\":" + e("\"U8\"", "[9223372036854775808]", "[0,0]") + "}", {},
         "tensor 'a': shape[0] is 9223372036854775808, larger than the int64 limit"},
        {"{\"a\":" + e("\"U8\"", "[4294967296,4294967296]", "[0,0]") + "}", {},
         "tensor 'a': shape [4294967296, 4294967296] has more elements than fit in 64 bits"},
        {"{\"a\":" + e("\"U8\"", "[4294967296,4294967296,0,3]", "[0,0]") + "}", {}, ""},  // empty: accepted
        {"{\"a\":" + e("\"F32\"", "[4611686018427387904]", "[0,0]") + "}", {},
         "tensor 'a': F32 x shape [4611686018427387904] overflows 64 bits of bytes"},
        {"{\"a\":" + e("\"F32\"", "[2]", "[0,4]") + "}", {1, 2, 3, 4},
         "tensor 'a': F32 x shape [2] is 8 bytes, but data_offsets [0, 4] span 4 bytes"},
        {"{\"a\":" + e("\"U8\"", "[0]", "[4,0]") + "}", {1, 2, 3, 4},
         "tensor 'a': data_offsets [4, 0] have begin > end"},
        {"{\"a\":" + e("\"U8\"", "[4]", "[0,4]") + "}", {1, 2},
         "tensor 'a': data_offsets [0, 4] run past the end of the data section (2 bytes)"},
        {"{\"a\":" + e("\"U8\"", "[1]", "[0]") + "}", {1},
         "tensor 'a': field 'data_offsets' must be [begin, end] with non-negative integers, found [0]"},
        {"{\"a\":" + e("\"U8\"", "[1]", "[0,1,2]") + "}", {1}, "found [0,1,2]"},
        {"{\"a\":" + e("\"U8\"", "[1]", "[-1,0]") + "}", {1}, "found [-1,0]"},
        {"{\"a\":" + e("\"U8\"", "[1]", "[0.0,1]") + "}", {1}, "found [0.0,1]"},
        {"{\"a\":" + e("\"U8\"", "[1]", "{\"b\":0}") + "}", {1}, "found {\"b\":0}"},
        {"{\"a\":" + e("\"U8\"", "[4]", "[0,4]") + ",\"b\":" + e("\"U8\"", "[4]", "[2,6]") + "}", {1, 2, 3, 4, 5, 6},
         "tensors 'a' (data_offsets [0, 4]) and 'b' (data_offsets [2, 6]) overlap"},
        {"{\"a\":" + e("\"U8\"", "[8]", "[0,8]") + ",\"b\":" + e("\"U8\"", "[0]", "[4,4]") + "}",
         {1, 2, 3, 4, 5, 6, 7, 8}, "tensors 'a' (data_offsets [0, 8]) and 'b' (data_offsets [4, 4]) overlap"},
        {"{\"x\":" + e("\"U8\"", "[4]", "[0,4]") + ",\"y\":" + e("\"U8\"", "[4]", "[0,4]") + "}", {1, 2, 3, 4},
         "tensors 'x' (data_offsets [0, 4]) and 'y' (data_offsets [0, 4]) overlap"},
        {"{\"a\":" + e("\"U8\"", "[2]", "[0,2]") + ",\"b\":" + e("\"U8\"", "[2]", "[4,6]") + "}", {1, 2, 3, 4, 5, 6},
         "bytes [2, 4) of the data section belong to no tensor (hole before tensor 'b')"},
        {"{\"a\":" + e("\"U8\"", "[2]", "[2,4]") + "}", {1, 2, 3, 4}, "bytes [0, 2) of the data section belong to no"},
        {"{\"a\":" + e("\"U8\"", "[2]", "[0,2]") + "}", {1, 2, 3, 4, 5},
         "3 trailing bytes after the last tensor's data (the data section is 5 bytes, tensors cover 2)"},
        {"{}", {1}, "1 trailing bytes after the last tensor's data"},
        {"{\"a\":" + e("\"U8\"", "[1]", "[0,1]") + ",\"a\":" + e("\"U8\"", "[1]", "[1,2]") + "}", {1, 2},
         "header: duplicate key \"a\" at the top level"},
        {R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", {1},
         "header: duplicate key \"dtype\" in \"a\""},
        {R"({"__metadata__":{"k":"1","k":"2"}})", {}, "header: duplicate key \"k\" in \"__metadata__\""},
        {R"({"__metadata__":"x"})", {}, "__metadata__: expected an object of string values, found string \"x\""},
        {R"({"__metadata__":["x"]})", {}, "__metadata__: expected an object of string values, found array"},
        {R"({"__metadata__":{"k":1}})", {}, "__metadata__: value of 'k' must be a string, found number 1"},
        {R"({"__metadata__":{"k":{"x":"y"}}})", {}, "__metadata__: value of 'k' must be a string, found object"},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.header);
        if (c.fragment.empty()) {
            Result<SafetensorsHeader> ok = parse_safetensors(file_image(c.header, c.data));
            EXPECT_TRUE(ok.has_value()) << ok.error().message;
            continue;
        }
        EXPECT_TRUE(has_fragment(open_error(c.header, c.data), c.fragment));
    }
}

TEST_F(SafetensorsTest, AcceptsValidEdgeLayouts) {
    // Whitespace around the JSON, two empty tensors at one boundary, an empty tensor at the end,
    // and metadata with an empty object.
    const std::string header =
        R"(  {"__metadata__":{},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)"
        R"("b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"c":{"dtype":"I16","shape":[2],"data_offsets":[0,4]},)"
        R"("d":{"dtype":"BOOL","shape":[],"data_offsets":[4,5]},"e":{"dtype":"F8_E4M3","shape":[0,7],)"
        R"("data_offsets":[5,5]}}    )";
    Result<SafetensorsHeader> h = parse_safetensors(file_image(header, {1, 2, 3, 4, 1}));
    ASSERT_TRUE(h.has_value()) << h.error().message;
    ASSERT_EQ(h->tensors.size(), 5u);
    EXPECT_EQ(h->tensors[0].name, "a");
    EXPECT_EQ(h->tensors[4].name, "e");
    EXPECT_EQ(h->tensors[4].dtype, DType::kF8E4M3);
    EXPECT_EQ(h->tensors[4].shape, (std::vector<int64_t>{0, 7}));
    EXPECT_EQ(h->tensors[3].data_begin, 4u);
    EXPECT_EQ(h->tensors[3].data_end, 5u);
    EXPECT_TRUE(h->metadata.empty());
    EXPECT_EQ(h->header_len, header.size());
}

TEST_F(SafetensorsTest, HeaderParsesEveryDTypeName) {
    for (DType t : kAllDTypes) {
        const size_t n = dtype_size(t);
        const std::string header = fmt::format(R"({{"x":{{"dtype":"{}","shape":[1],"data_offsets":[0,{}]}}}})",
                                               dtype_name(t), n);
        Result<SafetensorsHeader> h = parse_safetensors(file_image(header, std::vector<uint8_t>(n, 0)));
        ASSERT_TRUE(h.has_value()) << h.error().message;
        EXPECT_EQ(h->tensors[0].dtype, t);
    }
}

}  // namespace
}  // namespace memra::io
