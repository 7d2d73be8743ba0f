// What a draft-forcing backend (cpu::ForcedDraftBackend) imposes: speculation's drafts replaced before they feed
// anything, so that a measurement or a gate sees every acceptance pattern (drafts change speed, never output).
// Backend-independent: the runtime's verify sets it, the backend reads it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace memra {

// The drafts to impose on the next step (one sequence per step): draft k becomes ids[k] when >= 0.
struct DraftForcing {
    uint64_t step = 0;  // changed before every step
    std::array<int32_t, 3> ids = {-1, -1, -1};
};

// The forced drafts for a sequence of n_tokens tokens so far (the last one pending) so that exactly
// n_accept are accepted when `truth` holds the tokens the model samples: draft k is truth at its position for
// k < n_accept, another id at k = n_accept (positions past truth: id 0, which then may or may not stand).
inline std::array<int32_t, 3> drafts_accepting(const std::vector<int32_t> &truth, size_t n_tokens, int n_accept,
                                               int32_t vocab) {
    std::array<int32_t, 3> ids = {-1, -1, -1};
    for (int k = 0; k < 3; ++k) {
        const size_t at = n_tokens + static_cast<size_t>(k);  // the position draft k predicts
        const int32_t t = at < truth.size() ? truth[at] : 0;
        ids[static_cast<size_t>(k)] = k < n_accept ? t : (t + 1 + k) % vocab;
    }
    return ids;
}

}  // namespace memra
