// Tiny-checkpoint tensors: names and shapes of the official Step-3.5 layout (STEP35.md 5.1, 5.2,
// 5.3) filled with counter-based uniform values. Scales are chosen so activations stay O(1):
// linear weights have std 1/sqrt(fan_in), embeddings std 1, norm weights (stored as w, applied
// as 1 + w) lie in (-0.1, 0.1).
#include "make_tiny/tiny_weights.h"

#include <algorithm>
#include <bit>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "core/check.h"
#include "core/float_formats.h"
#include "core/fp8_block.h"

namespace memra::tools {

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio, splitmix64's increment
constexpr uint64_t kFixedOne = uint64_t{1} << 24;    // fixed-point unit of amplitudes and uniforms

// Norm weights: uniform(-0.1, 0.1), amplitude round(0.1 * 2^24).
constexpr uint64_t kNormAmplitudeFixed = 1677722;
// Router bias: uniform(-0.03, 0.03), amplitude round(0.03 * 2^24). The router logits z = a . w
// (a normed to RMS ~1, w with std 1/sqrt(d)) have std ~1, so the probabilities sigmoid(z) spread
// with std ~0.21, and the gap between the 8th and 9th largest of 16 averages 0.03-0.06 (measured
// per layer). A bias of that size reorders the top-8 for some tokens, while a token whose gap is
// wider than the bias difference keeps its selection: on the tiny seed-7 model it changes the set
// for about a quarter of the (token, MoE layer) pairs (tests/oracle/test_tiny_checkpoint.py).
constexpr uint64_t kRouterBiasAmplitudeFixed = 503316;

uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t fnv1a64(std::string_view s) {
    uint64_t h = 0xCBF29CE484222325ull;
    for (char c : s) {
        h ^= static_cast<unsigned char>(c);
        h *= 0x100000001B3ull;
    }
    return h;
}

uint64_t amplitude_of(const TinyWeightSpec &spec) {
    switch (spec.init) {
    case TinyInit::kWeight: return tiny_amplitude_fixed(spec.fan_in);
    case TinyInit::kNorm: return kNormAmplitudeFixed;
    case TinyInit::kRouterBias: return kRouterBiasAmplitudeFixed;
    }
    return 0;
}

void put_u16(std::span<std::byte> out, uint64_t i, uint16_t v) {
    out[2 * i] = static_cast<std::byte>(v & 0xFF);
    out[2 * i + 1] = static_cast<std::byte>(v >> 8);
}

void put_f32(std::span<std::byte> out, uint64_t i, float f) {
    auto v = std::bit_cast<uint32_t>(f);
    for (uint64_t k = 0; k < 4; ++k) {
        out[4 * i + k] = static_cast<std::byte>((v >> (8 * k)) & 0xFF);
    }
}

// Element i of a tensor as float, before the one rounding to BF16 (or the F32 store of a bias).
struct ValueGen {
    uint64_t stream;
    uint64_t amplitude;
    float value(uint64_t i) const {
        return tiny_scaled_uniform(tiny_uniform_odd(tiny_random_bits(stream, i)), amplitude);
    }
};

// The fewest elements a thread takes of a plain tensor: small tensors (norms, biases) stay on one thread.
constexpr int64_t kPlainGrain = int64_t{1} << 16;

// Elements [begin, end) of a plain tensor: BF16, or F32 for the router bias.
void fill_plain(const TinyWeightSpec &spec, const ValueGen &gen, uint64_t begin, uint64_t end,
                std::span<std::byte> out) {
    if (spec.init == TinyInit::kRouterBias) {
        for (uint64_t i = begin; i < end; ++i) put_f32(out, i, gen.value(i));
        return;
    }
    for (uint64_t i = begin; i < end; ++i) put_u16(out, i, f32_to_bf16(gen.value(i)));
}

// Task t of a stacked expert tensor [E, rows, cols] in FP8: expert t / row_blocks, rows [r0, r0 + 128) of it
// (the last block partial), quantized from its BF16 values. Every 128x128 scale block lies inside one task and
// quantize_fp8_block treats blocks independently, so the bytes are those of quantizing each expert whole.
// w: scratch for one task's [<= 128, cols] values; scale_inv: for its [col_blocks] scales.
void fill_fp8_task(const TinyWeightSpec &spec, const ValueGen &gen, int64_t t, std::vector<float> &w,
                   std::vector<float> &scale_inv, std::span<std::byte> codes, std::span<std::byte> scales) {
    const int64_t rows = spec.shape[1];
    const int64_t cols = spec.shape[2];
    const int64_t row_blocks = fp8_scale_blocks(rows);
    const int64_t col_blocks = fp8_scale_blocks(cols);
    const int64_t expert = t / row_blocks;
    const int64_t r0 = (t % row_blocks) * kFp8Block;
    const int64_t n_rows = std::min(rows - r0, kFp8Block);
    const auto base = static_cast<uint64_t>((expert * rows + r0) * cols);
    const auto n = static_cast<uint64_t>(n_rows * cols);
    for (uint64_t j = 0; j < n; ++j) w[j] = bf16_to_f32(f32_to_bf16(gen.value(base + j)));
    quantize_fp8_block(w.data(), n_rows, cols, reinterpret_cast<uint8_t *>(codes.data() + base), scale_inv.data());
    const auto scale_base = static_cast<uint64_t>(t * col_blocks);
    for (int64_t j = 0; j < col_blocks; ++j) {
        put_f32(scales, scale_base + static_cast<uint64_t>(j), scale_inv[static_cast<size_t>(j)]);
    }
}

void add_weight(std::vector<TinyWeightSpec> &specs, std::string name, std::vector<int64_t> shape, bool expert = false) {
    // fan_in is the last dimension: PyTorch [out, in] (or stacked [E, out, in]).
    auto fan_in = static_cast<uint64_t>(shape.back());
    specs.push_back({std::move(name), std::move(shape), TinyInit::kWeight, fan_in, expert});
}

void add_norm(std::vector<TinyWeightSpec> &specs, std::string name, int64_t dim) {
    specs.push_back({std::move(name), {dim}, TinyInit::kNorm, 1, false});
}

std::vector<TinyWeightSpec> tensor_specs(const TinyPreset &p) {
    std::vector<TinyWeightSpec> specs;
    int64_t d = p.d_model;
    // Embedding: std 1 (fan_in 1), so the residual stream starts at RMS ~1.
    specs.push_back({"model.embed_tokens.weight", {p.vocab_size, d}, TinyInit::kWeight, 1, false});
    for (int64_t layer = 0; layer < p.n_total_layers(); ++layer) {
        std::string pre = fmt::format("model.layers.{}.", layer);
        bool mtp = layer >= p.n_layers;
        int64_t q_dim = p.n_heads(layer) * p.head_dim;
        int64_t kv_dim = p.n_kv_heads * p.head_dim;
        if (mtp) {
            add_norm(specs, pre + "enorm.weight", d);
            add_norm(specs, pre + "hnorm.weight", d);
            add_weight(specs, pre + "eh_proj.weight", {d, 2 * d});
        }
        add_norm(specs, pre + "input_layernorm.weight", d);
        add_weight(specs, pre + "self_attn.q_proj.weight", {q_dim, d});
        add_weight(specs, pre + "self_attn.k_proj.weight", {kv_dim, d});
        add_weight(specs, pre + "self_attn.v_proj.weight", {kv_dim, d});
        add_weight(specs, pre + "self_attn.g_proj.weight", {p.n_heads(layer), d});
        add_norm(specs, pre + "self_attn.q_norm.weight", p.head_dim);
        add_norm(specs, pre + "self_attn.k_norm.weight", p.head_dim);
        add_weight(specs, pre + "self_attn.o_proj.weight", {d, q_dim});
        add_norm(specs, pre + "post_attention_layernorm.weight", d);
        if (p.is_moe(layer)) {
            add_weight(specs, pre + "moe.gate.weight", {p.n_experts, d});
            specs.push_back({pre + "moe.router_bias", {p.n_experts}, TinyInit::kRouterBias, 1, false});
            add_weight(specs, pre + "moe.gate_proj.weight", {p.n_experts, p.d_expert, d}, true);
            add_weight(specs, pre + "moe.up_proj.weight", {p.n_experts, p.d_expert, d}, true);
            add_weight(specs, pre + "moe.down_proj.weight", {p.n_experts, d, p.d_expert}, true);
            add_weight(specs, pre + "share_expert.gate_proj.weight", {p.d_shared, d});
            add_weight(specs, pre + "share_expert.up_proj.weight", {p.d_shared, d});
            add_weight(specs, pre + "share_expert.down_proj.weight", {d, p.d_shared});
        } else {
            add_weight(specs, pre + "mlp.gate_proj.weight", {p.d_ff, d});
            add_weight(specs, pre + "mlp.up_proj.weight", {p.d_ff, d});
            add_weight(specs, pre + "mlp.down_proj.weight", {d, p.d_ff});
        }
        if (mtp) {
            add_norm(specs, pre + "transformer.shared_head.norm.weight", d);
            add_weight(specs, pre + "transformer.shared_head.output.weight", {p.vocab_size, d});
        }
    }
    add_norm(specs, "model.norm.weight", d);
    add_weight(specs, "lm_head.weight", {p.vocab_size, d});
    return specs;
}

}  // namespace

uint64_t tiny_tensor_stream(uint64_t seed, std::string_view tensor_name) {
    return mix64(mix64(seed + kGolden) ^ fnv1a64(tensor_name));
}

uint64_t tiny_random_bits(uint64_t stream, uint64_t index) {
    // splitmix64 output number index of the generator whose state starts at stream.
    return mix64(stream + (index + 1) * kGolden);
}

int64_t tiny_uniform_odd(uint64_t bits) {
    auto k = static_cast<int64_t>(bits >> 40);  // top 24 bits
    return 2 * k + 1 - static_cast<int64_t>(kFixedOne);
}

uint64_t isqrt_u64(uint64_t n) {
    if (n < 2) {
        return n;
    }
    // Start above sqrt(n) and descend: x_{k+1} = (x_k + n / x_k) / 2 decreases until floor(sqrt(n)).
    uint64_t x = uint64_t{1} << ((std::bit_width(n) + 1) / 2);
    while (true) {
        uint64_t y = (x + n / x) / 2;
        if (y >= x) {
            return x;
        }
        x = y;
    }
}

uint64_t tiny_amplitude_fixed(uint64_t fan_in) {
    MEMRA_CHECK(fan_in >= 1, "fan_in must be positive");
    // floor(sqrt(floor(X))) == floor(sqrt(X)) for X >= 0, so this is exactly floor(sqrt(3/fan_in) * 2^24).
    return isqrt_u64((uint64_t{3} << 48) / fan_in);
}

float tiny_scaled_uniform(int64_t odd, uint64_t amplitude_fixed) {
    // |odd| < 2^24 and amplitude_fixed < 2^25: the product is an integer below 2^49, exact in
    // double, and the power-of-two scale is exact too; the only rounding is the cast to float.
    double product = static_cast<double>(odd) * static_cast<double>(amplitude_fixed);
    return static_cast<float>(product * 0x1p-48);
}

TinyWeights::TinyWeights(const TinyPreset &preset, uint64_t seed, bool fp8)
    : specs_(tensor_specs(preset)), seed_(seed) {
    uint64_t offset = 0;
    const auto add = [&](size_t spec, std::string name, DType dtype, std::vector<int64_t> shape, TinyPart part) {
        TinyTensor t;
        t.info.name = std::move(name);
        t.info.dtype = dtype;
        t.info.shape = std::move(shape);
        t.info.data_begin = offset;
        t.info.data_end = offset + t.info.n_elements() * dtype_size(dtype);
        offset = t.info.data_end;
        t.part = part;
        t.spec = spec;
        tensors_.push_back(std::move(t));
    };
    for (size_t i = 0; i < specs_.size(); ++i) {
        const TinyWeightSpec &spec = specs_[i];
        if (fp8 && spec.routed_expert) {
            MEMRA_CHECK(spec.shape.size() == 3, "{}: stacked expert tensor must be 3-D", spec.name);
            add(i, spec.name, DType::kF8E4M3, spec.shape, TinyPart::kFp8Codes);
            add(i, spec.name + "_scale_inv", DType::kF32,
                {spec.shape[0], fp8_scale_blocks(spec.shape[1]), fp8_scale_blocks(spec.shape[2])},
                TinyPart::kFp8Scales);
        } else {
            add(i, spec.name, spec.init == TinyInit::kRouterBias ? DType::kF32 : DType::kBF16, spec.shape,
                TinyPart::kValues);
        }
    }
}

uint64_t TinyWeights::total_bytes() const { return tensors_.empty() ? 0 : tensors_.back().info.data_end; }

void TinyWeights::generate(size_t i, std::span<std::byte> out, ThreadPool &pool) const {
    const TinyTensor &t = tensors_.at(i);
    MEMRA_CHECK(t.part == TinyPart::kValues, "{}: an FP8 tensor comes from generate_fp8", t.info.name);
    MEMRA_CHECK(out.size() == t.info.n_bytes(), "{}: {} bytes given, {} needed", t.info.name, out.size(),
                t.info.n_bytes());
    const TinyWeightSpec &spec = specs_[t.spec];
    const ValueGen gen{tiny_tensor_stream(seed_, spec.name), amplitude_of(spec)};
    pool.parallel_for(
        static_cast<int64_t>(t.info.n_elements()),
        [&](int64_t begin, int64_t end) {
            fill_plain(spec, gen, static_cast<uint64_t>(begin), static_cast<uint64_t>(end), out);
        },
        kPlainGrain);
}

void TinyWeights::generate_fp8(size_t i, std::span<std::byte> codes, std::span<std::byte> scales,
                               ThreadPool &pool) const {
    const TinyTensor &q = tensors_.at(i);
    MEMRA_CHECK(q.part == TinyPart::kFp8Codes && i + 1 < tensors_.size(), "{}: not the codes of an FP8 tensor",
                q.info.name);
    const TinyTensor &s = tensors_[i + 1];
    MEMRA_CHECK(codes.size() == q.info.n_bytes() && scales.size() == s.info.n_bytes(),
                "{}: {} + {} bytes given, {} + {} needed", q.info.name, codes.size(), scales.size(),
                q.info.n_bytes(), s.info.n_bytes());
    const TinyWeightSpec &spec = specs_[q.spec];
    const ValueGen gen{tiny_tensor_stream(seed_, spec.name), amplitude_of(spec)};
    const int64_t n_tasks = spec.shape[0] * fp8_scale_blocks(spec.shape[1]);
    pool.parallel_for(n_tasks, [&](int64_t begin, int64_t end) {
        std::vector<float> w(static_cast<size_t>(std::min(spec.shape[1], kFp8Block) * spec.shape[2]));
        std::vector<float> scale_inv(static_cast<size_t>(fp8_scale_blocks(spec.shape[2])));
        for (int64_t t = begin; t < end; ++t) fill_fp8_task(spec, gen, t, w, scale_inv, codes, scales);
    });
}

std::vector<io::TensorData> make_tiny_tensors(const TinyPreset &preset, uint64_t seed, bool fp8) {
    const TinyWeights weights(preset, seed, fp8);
    ThreadPool pool(static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 16)));
    const std::vector<TinyTensor> &tensors = weights.tensors();
    std::vector<io::TensorData> out(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
        out[i].name = tensors[i].info.name;
        out[i].dtype = tensors[i].info.dtype;
        out[i].shape = tensors[i].info.shape;
        out[i].bytes.resize(tensors[i].info.n_bytes());
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
        switch (tensors[i].part) {
        case TinyPart::kValues: weights.generate(i, out[i].bytes, pool); break;
        case TinyPart::kFp8Codes: weights.generate_fp8(i, out[i].bytes, out[i + 1].bytes, pool); break;
        case TinyPart::kFp8Scales: break;  // written with its codes
        }
    }
    return out;
}

}  // namespace memra::tools
