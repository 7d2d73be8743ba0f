// Deterministic weights of the tiny checkpoint. Every value comes from a counter-based hash of
// (seed, tensor name, element index) and exact integer arithmetic, so a tensor's bytes depend on
// nothing else (not on generation order, libm or the machine).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "make_tiny/tiny_presets.h"

namespace memra::tools {

// The random stream of one tensor: a hash of the seed and the tensor's name.
uint64_t tiny_tensor_stream(uint64_t seed, std::string_view tensor_name);
// 64 random bits for element index of a stream: output number index of splitmix64 started at
// stream (streams are 64-bit hashes, so two tensors' sequences never meet in practice).
uint64_t tiny_random_bits(uint64_t stream, uint64_t index);
// The top 24 bits as an odd integer in [-(2^24 - 1), 2^24 - 1]: uniform on (-1, 1) after
// dividing by 2^24, symmetric around 0 and exactly representable in float.
int64_t tiny_uniform_odd(uint64_t bits);

// floor(sqrt(n)) for any 64-bit n (integer Newton iteration; no floating point).
uint64_t isqrt_u64(uint64_t n);
// The uniform amplitude a = sqrt(3 / fan_in) (so the std a / sqrt(3) is 1 / sqrt(fan_in)), as the
// exact fixed-point value floor(a * 2^24) = isqrt(floor(3 * 2^48 / fan_in)).
uint64_t tiny_amplitude_fixed(uint64_t fan_in);
// One weight: (odd / 2^24) * (amplitude_fixed / 2^24), formed exactly in double (the product has
// at most 49 bits) and rounded once to float.
float tiny_scaled_uniform(int64_t odd, uint64_t amplitude_fixed);

// What a stored tensor holds: its values (BF16 weights and norms, the F32 router bias), or one half of an FP8
// routed-expert tensor: the F8_E4M3 codes, or their F32 `_scale_inv` block scales (the entry after the codes).
enum class TinyPart { kValues, kFp8Codes, kFp8Scales };

// How a weight's values are drawn.
enum class TinyInit {
    kWeight,      // uniform with std 1/sqrt(fan_in) (fan_in = 1 for the embedding: std 1)
    kNorm,        // uniform(-0.1, 0.1), stored as w of the (1 + w) convention
    kRouterBias,  // uniform(-0.03, 0.03), F32
};

// One generated weight: a tensor of the bf16 checkpoint (a routed-expert one becomes two tensors in fp8).
struct TinyWeightSpec {
    std::string name;
    std::vector<int64_t> shape;  // PyTorch order: [out, in] or stacked [E, out, in]
    TinyInit init = TinyInit::kWeight;
    uint64_t fan_in = 1;
    bool routed_expert = false;  // FP8-quantized in the fp8 variant
};

// One stored tensor of the checkpoint, before its bytes exist.
struct TinyTensor {
    io::TensorInfo info;  // name, dtype, shape; offsets in the concatenation of the tensors in checkpoint order
    TinyPart part = TinyPart::kValues;
    size_t spec = 0;      // the generated weight it comes from (an FP8 tensor's codes and scales share one)
};

// The bytes of every tensor of one preset, seed and format, each produced on its own: a tensor's bytes depend on
// (seed, name, element index) only, so one tensor is split over threads by element ranges (values) or by
// (expert, 128-row block) tasks (FP8, each task quantizing its own scale blocks), with identical bytes for any
// thread count. Plain data; generate() is const and may run for different tensors at once.
class TinyWeights {
public:
    TinyWeights(const TinyPreset &preset, uint64_t seed, bool fp8);

    // Every stored tensor in checkpoint order (embedding, layers 0.., MTP layers, final norm, lm_head). With fp8,
    // the routed experts are F8_E4M3 plus F32 `_scale_inv` block scales, quantized from exactly the BF16 values
    // the bf16 variant stores.
    const std::vector<TinyTensor> &tensors() const { return tensors_; }
    uint64_t total_bytes() const;

    // Writes tensor i (a kValues one) into out, exactly its n_bytes(), on the pool's threads.
    void generate(size_t i, std::span<std::byte> out, ThreadPool &pool) const;
    // Writes the FP8 tensor whose codes are tensor i (kFp8Codes) and whose scales are tensor i + 1: one pass over
    // its values gives both.
    void generate_fp8(size_t i, std::span<std::byte> codes, std::span<std::byte> scales, ThreadPool &pool) const;

private:
    std::vector<TinyWeightSpec> specs_;
    std::vector<TinyTensor> tensors_;
    uint64_t seed_ = 0;
};

// Every tensor of the preset in checkpoint order (TinyWeights::tensors), with its bytes, generated on the
// machine's threads: what make-tiny writes.
std::vector<io::TensorData> make_tiny_tensors(const TinyPreset &preset, uint64_t seed, bool fp8);

}  // namespace memra::tools
