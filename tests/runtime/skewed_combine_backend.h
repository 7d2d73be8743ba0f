// A CPU backend that finishes the canonical block tree left to right, ((s0 + s1) + s2) + s3 ..., instead of
// the balanced tree: the canonical order for 2 ranks, another order for 4 and 8. memra verify's tests use it
// to show that the gates fail on a perturbed reduction order.
#pragma once

#include <cstdint>

#include "backend/cpu/cpu_backend.h"

namespace memra::runtime {

class SkewedCombineBackend : public cpu::CpuBackend {
public:
    using cpu::CpuBackend::CpuBackend;
    void canonical_combine(TensorView subtree_sums, TensorView out) override {
        count_launch();
        const int64_t tp = subtree_sums.rows();
        const int64_t n = out.numel();
        const auto *in = static_cast<const float *>(subtree_sums.data);
        auto *o = static_cast<float *>(out.data);
        for (int64_t i = 0; i < n; ++i) {
            float s = in[i];
            for (int64_t r = 1; r < tp; ++r) s = s + in[r * n + i];
            o[i] = s;
        }
    }
};

}  // namespace memra::runtime
