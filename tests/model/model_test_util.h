// Helpers shared by the model tests: the release config fixtures, synthetic tensor listings, seeded token
// ids and raw-bit comparison of logits.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "model/step35_config.h"
#include "model/step35_weights.h"

namespace memra::model {

// Parses tests/data/<file>; a parse failure fails the calling test.
inline Step35Config load_fixture(const char *file) {
    std::ifstream in(std::filesystem::path(MEMRA_SOURCE_DIR) / "tests/data" / file, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    auto cfg = parse_step35_config(s.str());
    EXPECT_TRUE(cfg.has_value()) << (cfg ? "" : cfg.error().message);
    return cfg ? *cfg : Step35Config{};
}

// A checkpoint listing that matches the catalogue exactly, at the released (first) dtypes.
inline std::vector<io::TensorInfo> as_checkpoint(const std::vector<ExpectedTensor> &catalogue) {
    std::vector<io::TensorInfo> out;
    uint64_t offset = 0;
    for (const ExpectedTensor &e : catalogue) {
        uint64_t n = 1;
        for (int64_t d : e.shape) {
            n *= static_cast<uint64_t>(d);
        }
        const uint64_t end = offset + n * dtype_size(e.dtypes.front());
        out.push_back(io::TensorInfo{e.name, e.dtypes.front(), e.shape, offset, end});
        offset = end;
    }
    return out;
}

// n ids in [0, vocab) from a 64-bit LCG keyed by seed.
inline std::vector<int32_t> make_tokens(uint64_t seed, size_t n, int32_t vocab) {
    std::vector<int32_t> out(n);
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (auto &t : out) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        t = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(vocab));
    }
    return out;
}

// Counts raw-bit mismatches between two float vectors (a size mismatch counts every element).
inline int64_t bit_mismatches(const std::vector<float> &a, const std::vector<float> &b) {
    if (a.size() != b.size()) return static_cast<int64_t>(std::max(a.size(), b.size()));
    int64_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        n += std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]) ? 1 : 0;
    }
    return n;
}

}  // namespace memra::model
