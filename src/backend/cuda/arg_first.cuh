// The arg-max order shared by the router's top-k and the sampler: (v, id) comes before (bv, bid) when v is larger,
// or equal with the lower id; an id < 0 is "none", after everything. Callers never pass a NaN value with an id >= 0
// (the router scores NaN as -Inf), so this is a strict total order and every reduction tree finds the same first
// element: the CPU's "largest, ties to the lower index".
#pragma once

#include <cstdint>

namespace memra::cuda {

__device__ __forceinline__ bool first_before(float v, int32_t id, float bv, int32_t bid) {
    if (id < 0) return false;
    if (bid < 0) return true;
    return v > bv || (v == bv && id < bid);
}

// The first of the warp's 32 (v, id) in that order, by a shfl_xor butterfly; every lane ends holding it.
__device__ __forceinline__ void warp_first(float &v, int32_t &id) {
    for (int offset = 16; offset > 0; offset /= 2) {
        const float other_v = __shfl_xor_sync(0xffffffffu, v, offset);
        const int32_t other_id = __shfl_xor_sync(0xffffffffu, id, offset);
        if (first_before(other_v, other_id, v, id)) {
            v = other_v;
            id = other_id;
        }
    }
}

}  // namespace memra::cuda
