// The draft-forcing kernel (ops_forcing.h).
#include "backend/cuda/ops_forcing.h"

namespace memra::cuda {

namespace {

__global__ void force_draft_kernel(char *tokens, int64_t n_tokens, int64_t token_bytes, const int32_t *pairs,
                                   int32_t id) {
    const int32_t t = pairs[0];
    if (t >= 0 && t < n_tokens) *reinterpret_cast<int32_t *>(tokens + t * token_bytes) = id;
}

}  // namespace

cudaError_t force_draft_id(void *tokens, int64_t n_tokens, int64_t token_bytes, const int32_t *pairs, int32_t id,
                           cudaStream_t stream) {
    if (tokens == nullptr || pairs == nullptr || n_tokens < 0 || token_bytes < 4 || token_bytes % 4 != 0) {
        return cudaErrorInvalidValue;
    }
    force_draft_kernel<<<1, 1, 0, stream>>>(static_cast<char *>(tokens), n_tokens, token_bytes, pairs, id);
    return cudaGetLastError();
}

}  // namespace memra::cuda
