// The tiny checkpoints a model test suite shares: one bf16 and one fp8 checkpoint written by the generator
// into the temp directory when the suite starts, removed when it ends.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <system_error>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "make_tiny/make_tiny.h"

namespace memra::model {

class TinyDirs {
public:
    // Writes memra_<suite>_<pid>_bf16 and _fp8 with the given seeds; a failure fails the calling test.
    TinyDirs(const std::string &suite, uint64_t bf16_seed, uint64_t fp8_seed) {
        for (const char *dtype : {"bf16", "fp8"}) {
            const std::filesystem::path dir =
                std::filesystem::temp_directory_path() / fmt::format("memra_{}_{}_{}", suite, ::getpid(), dtype);
            tools::TinyOptions opt;
            opt.out_dir = dir;
            opt.seed = std::string(dtype) == "bf16" ? bf16_seed : fp8_seed;
            opt.dtype = dtype;
            opt.force = true;
            auto made = tools::make_tiny_checkpoint(opt);
            EXPECT_TRUE(made.has_value()) << made.error().message;
            dirs_[dtype] = dir;
        }
    }
    ~TinyDirs() {
        for (const auto &[dtype, dir] : dirs_) {
            std::error_code ec;
            std::filesystem::remove_all(dir, ec);
        }
    }
    TinyDirs(const TinyDirs &) = delete;
    TinyDirs &operator=(const TinyDirs &) = delete;

    // The checkpoint of "bf16" or "fp8".
    const std::filesystem::path &at(const std::string &dtype) const { return dirs_.at(dtype); }

private:
    std::map<std::string, std::filesystem::path> dirs_;
};

}  // namespace memra::model
