// Tiny-checkpoint tensors: names and shapes of the official Step-3.5 layout (STEP35.md 5.1, 5.2,
// 5.3) filled with counter-based uniform values. Scales are chosen so activations stay O(1):
// linear weights have std 1/sqrt(fan_in), embeddings std 1, norm weights (stored as w, applied
// as 1 + w) lie in (-0.1, 0.1).
#include "make_tiny/tiny_weights.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
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

enum class InitKind {
    kWeight,      // uniform with std 1/sqrt(fan_in) (fan_in = 1 for the embedding: std 1)
    kNorm,        // uniform(-0.1, 0.1), stored as w of the (1 + w) convention
    kRouterBias,  // uniform(-0.03, 0.03), F32
};

struct TensorSpec {
    std::string name;
    std::vector<int64_t> shape;  // PyTorch order: [out, in] or stacked [E, out, in]
    InitKind kind = InitKind::kWeight;
    uint64_t fan_in = 1;
    bool routed_expert = false;  // FP8-quantized in the fp8 variant
};

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

uint64_t n_elements(const std::vector<int64_t> &shape) {
    uint64_t n = 1;
    for (int64_t s : shape) {
        n *= static_cast<uint64_t>(s);
    }
    return n;
}

uint64_t amplitude_of(const TensorSpec &spec) {
    switch (spec.kind) {
    case InitKind::kWeight: return tiny_amplitude_fixed(spec.fan_in);
    case InitKind::kNorm: return kNormAmplitudeFixed;
    case InitKind::kRouterBias: return kRouterBiasAmplitudeFixed;
    }
    return 0;
}

void put_u16(std::vector<std::byte> &out, uint64_t i, uint16_t v) {
    out[2 * i] = static_cast<std::byte>(v & 0xFF);
    out[2 * i + 1] = static_cast<std::byte>(v >> 8);
}

void put_f32(std::vector<std::byte> &out, uint64_t i, float f) {
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

io::TensorData generate_plain(const TensorSpec &spec, uint64_t seed) {
    ValueGen gen{tiny_tensor_stream(seed, spec.name), amplitude_of(spec)};
    uint64_t n = n_elements(spec.shape);
    io::TensorData t;
    t.name = spec.name;
    t.shape = spec.shape;
    if (spec.kind == InitKind::kRouterBias) {
        t.dtype = DType::kF32;
        t.bytes.resize(4 * n);
        for (uint64_t i = 0; i < n; ++i) {
            put_f32(t.bytes, i, gen.value(i));
        }
        return t;
    }
    t.dtype = DType::kBF16;
    t.bytes.resize(2 * n);
    for (uint64_t i = 0; i < n; ++i) {
        put_u16(t.bytes, i, f32_to_bf16(gen.value(i)));
    }
    return t;
}

// A stacked expert tensor [E, rows, cols] as F8_E4M3 plus its F32 [E, ceil(rows/128),
// ceil(cols/128)] scales, each expert's matrix quantized on its own from its BF16 values.
void generate_fp8(const TensorSpec &spec, uint64_t seed, std::vector<io::TensorData> &out) {
    MEMRA_CHECK(spec.shape.size() == 3, "{}: stacked expert tensor must be 3-D", spec.name);
    ValueGen gen{tiny_tensor_stream(seed, spec.name), amplitude_of(spec)};
    int64_t n_experts = spec.shape[0];
    int64_t rows = spec.shape[1];
    int64_t cols = spec.shape[2];
    int64_t row_blocks = fp8_scale_blocks(rows);
    int64_t col_blocks = fp8_scale_blocks(cols);
    auto per_expert = static_cast<uint64_t>(rows * cols);
    auto scales_per_expert = static_cast<uint64_t>(row_blocks * col_blocks);

    io::TensorData q;
    q.name = spec.name;
    q.dtype = DType::kF8E4M3;
    q.shape = spec.shape;
    q.bytes.resize(per_expert * static_cast<uint64_t>(n_experts));
    io::TensorData s;
    s.name = spec.name + "_scale_inv";
    s.dtype = DType::kF32;
    s.shape = {n_experts, row_blocks, col_blocks};
    s.bytes.resize(4 * scales_per_expert * static_cast<uint64_t>(n_experts));

    std::vector<float> w(per_expert);                 // [rows, cols] f32, one expert's BF16 values
    std::vector<uint8_t> codes(per_expert);           // [rows, cols] e4m3 bits
    std::vector<float> scale_inv(scales_per_expert);  // [row_blocks, col_blocks]
    for (int64_t e = 0; e < n_experts; ++e) {
        uint64_t base = per_expert * static_cast<uint64_t>(e);
        for (uint64_t j = 0; j < per_expert; ++j) {
            w[j] = bf16_to_f32(f32_to_bf16(gen.value(base + j)));
        }
        quantize_fp8_block(w.data(), rows, cols, codes.data(), scale_inv.data());
        std::memcpy(q.bytes.data() + base, codes.data(), per_expert);
        for (uint64_t j = 0; j < scales_per_expert; ++j) {
            put_f32(s.bytes, scales_per_expert * static_cast<uint64_t>(e) + j, scale_inv[j]);
        }
    }
    out.push_back(std::move(q));
    out.push_back(std::move(s));
}

void add_weight(std::vector<TensorSpec> &specs, std::string name, std::vector<int64_t> shape, bool expert = false) {
    // fan_in is the last dimension: PyTorch [out, in] (or stacked [E, out, in]).
    auto fan_in = static_cast<uint64_t>(shape.back());
    specs.push_back({std::move(name), std::move(shape), InitKind::kWeight, fan_in, expert});
}

void add_norm(std::vector<TensorSpec> &specs, std::string name, int64_t dim) {
    specs.push_back({std::move(name), {dim}, InitKind::kNorm, 1, false});
}

std::vector<TensorSpec> tensor_specs(const TinyPreset &p) {
    std::vector<TensorSpec> specs;
    int64_t d = p.d_model;
    // Embedding: std 1 (fan_in 1), so the residual stream starts at RMS ~1.
    specs.push_back({"model.embed_tokens.weight", {p.vocab_size, d}, InitKind::kWeight, 1, false});
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
            specs.push_back({pre + "moe.router_bias", {p.n_experts}, InitKind::kRouterBias, 1, false});
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

std::vector<io::TensorData> make_tiny_tensors(const TinyPreset &preset, uint64_t seed, bool fp8) {
    const std::vector<TensorSpec> specs = tensor_specs(preset);
    // Tensors are independent (each a function of seed and name only), so worker threads take them
    // in any order; each result lands in its spec's slot and the output order is the spec order.
    std::vector<std::vector<io::TensorData>> slots(specs.size());
    std::atomic<size_t> next{0};
    auto worker = [&]() {
        for (size_t i = next++; i < specs.size(); i = next++) {
            if (fp8 && specs[i].routed_expert) {
                generate_fp8(specs[i], seed, slots[i]);
            } else {
                slots[i].push_back(generate_plain(specs[i], seed));
            }
        }
    };
    size_t n_threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16);
    {
        std::vector<std::jthread> threads;
        for (size_t t = 1; t < n_threads; ++t) {
            threads.emplace_back(worker);
        }
        worker();
    }
    std::vector<io::TensorData> tensors;
    for (std::vector<io::TensorData> &slot : slots) {
        for (io::TensorData &t : slot) {
            tensors.push_back(std::move(t));
        }
    }
    return tensors;
}

}  // namespace memra::tools
