// Helpers shared by the model tests: the release config fixtures and synthetic tensor listings.
#pragma once

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

}  // namespace memra::model
