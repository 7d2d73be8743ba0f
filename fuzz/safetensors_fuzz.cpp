// libFuzzer target for parse_safetensors: any input must give an Error or a header whose tensors
// lie inside the data section, tile it without overlap and have byte sizes equal to
// dtype x shape. Every accepted tensor's bytes are read, so ASan sees any range past the input.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "io/safetensors.h"

namespace {

void check_header(std::span<const std::byte> input, const memra::io::SafetensorsHeader &header) {
    if (input.size() < 8 || header.header_len > input.size() - 8) __builtin_trap();
    const std::span<const std::byte> data = input.subspan(8 + header.header_len);
    std::vector<const memra::io::TensorInfo *> by_offset;
    for (size_t i = 0; i < header.tensors.size(); ++i) {
        const memra::io::TensorInfo &t = header.tensors[i];
        if (i > 0 && !(header.tensors[i - 1].name < t.name)) __builtin_trap();  // sorted, unique
        if (t.data_begin > t.data_end || t.data_end > data.size()) __builtin_trap();
        uint64_t n_elements = 1;
        for (int64_t d : t.shape) {
            if (d < 0) __builtin_trap();
            if (__builtin_mul_overflow(n_elements, static_cast<uint64_t>(d), &n_elements)) n_elements = UINT64_MAX;
        }
        if (std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end()) n_elements = 0;
        if (n_elements != t.n_elements()) __builtin_trap();
        if (n_elements * memra::dtype_size(t.dtype) != t.n_bytes()) __builtin_trap();
        // Touch every byte of the tensor.
        unsigned sum = 0;
        for (std::byte b : data.subspan(t.data_begin, t.n_bytes())) sum += std::to_integer<unsigned>(b);
        volatile unsigned sink = sum;
        (void)sink;
        by_offset.push_back(&t);
    }
    std::sort(by_offset.begin(), by_offset.end(), [](const auto *a, const auto *b) {
        return a->data_begin != b->data_begin ? a->data_begin < b->data_begin : a->data_end < b->data_end;
    });
    uint64_t covered = 0;
    for (const memra::io::TensorInfo *t : by_offset) {
        if (t->data_begin != covered) __builtin_trap();  // overlap or hole
        covered = t->data_end;
    }
    if (covered != data.size()) __builtin_trap();  // trailing bytes
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *bytes, size_t size) {
    const std::span<const std::byte> input(reinterpret_cast<const std::byte *>(bytes), size);
    memra::Result<memra::io::SafetensorsHeader> header = memra::io::parse_safetensors(input);
    if (header) check_header(input, *header);
    return 0;
}
