// Deterministic weights of the tiny checkpoint. Every value comes from a counter-based hash of
// (seed, tensor name, element index) and exact integer arithmetic, so a tensor's bytes depend on
// nothing else (not on generation order, libm or the machine).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

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

// Every tensor of the preset, in checkpoint order (embedding, layers 0.., MTP layers, final norm,
// lm_head). With fp8, the routed experts become F8_E4M3 plus F32 `_scale_inv` block scales,
// quantized from exactly the BF16 values the bf16 variant stores.
std::vector<io::TensorData> make_tiny_tensors(const TinyPreset &preset, uint64_t seed, bool fp8);

}  // namespace memra::tools
