// The draft-forcing kernel of CudaBackend (cpu::ForcedDraftBackend's rule on the GPU): speculation's draft of a
// stage replaced before it feeds anything, for `bench --spec-accept` and the SPECULATION gate.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace memra::cuda {

// tokens[pairs[0]].id = id, the pair read on the device: tokens are n_tokens records of token_bytes bytes (a
// multiple of 4) whose first member is the i32 id (SampledToken); a pairs[0] outside [0, n_tokens) writes nothing.
cudaError_t force_draft_id(void *tokens, int64_t n_tokens, int64_t token_bytes, const int32_t *pairs, int32_t id,
                           cudaStream_t stream);

}  // namespace memra::cuda
