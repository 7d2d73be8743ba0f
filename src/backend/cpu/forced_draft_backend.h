// A CPU backend whose speculative drafts can be replaced: for measuring speculation at a chosen acceptance
// (`memra bench --spec-accept N` on random checkpoints, whose MTP layers draft nothing the trunk accepts) and for
// the D8 tests, which force every acceptance pattern. The replaced draft is what the engine verifies, feeds to
// the trunk and reports, so the output must not change whatever the drafts are.
#pragma once

#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/draft_forcing.h"

namespace memra::cpu {

class ForcedDraftBackend : public CpuBackend {
public:
    // forcing: read at every draft scatter; must outlive the backend.
    ForcedDraftBackend(int n_threads, Numerics numerics, const DraftForcing *forcing)
        : CpuBackend(n_threads, numerics), forcing_(forcing) {}

    // Stage k of a step scatters draft k: overwrite it first.
    void scatter_ids(TensorView tokens, TensorView pairs, TensorView dst) override {
        if (seen_ != forcing_->step) {
            seen_ = forcing_->step;
            stage_ = 0;
        }
        const int k = stage_++;
        if (k < 3 && forcing_->ids[static_cast<size_t>(k)] >= 0 && pairs.numel() >= 2) {
            const int32_t src = static_cast<const int32_t *>(pairs.data)[0];
            static_cast<SampledToken *>(tokens.data)[src].id = forcing_->ids[static_cast<size_t>(k)];
        }
        CpuBackend::scatter_ids(tokens, pairs, dst);
    }

private:
    const DraftForcing *forcing_;
    uint64_t seen_ = ~uint64_t{0};
    int stage_ = 0;
};

}  // namespace memra::cpu
