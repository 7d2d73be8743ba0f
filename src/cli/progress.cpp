// Shard progress printer (see progress.h).
#include "cli/progress.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <unistd.h>

namespace memra::cli {

io::ShardProgress shard_progress_printer() {
    const bool tty = isatty(STDERR_FILENO) != 0;
    return [tty](size_t done, size_t total, const std::filesystem::path &shard) {
        const std::string name = shard.filename().string();
        if (tty) {
            constexpr size_t kWidth = 30;
            const size_t filled = total ? done * kWidth / total : kWidth;
            std::fprintf(stderr, "\rLoading safetensors shards: [%s%s] %zu/%zu %s\x1b[K",
                         std::string(filled, '#').c_str(), std::string(kWidth - filled, ' ').c_str(), done, total,
                         name.c_str());
            if (done == total) std::fputc('\n', stderr);
        } else {
            std::fprintf(stderr, "Loading safetensors shards: %zu/%zu %s\n", done, total, name.c_str());
        }
        std::fflush(stderr);
    };
}

std::function<void(int64_t done)> upload_progress_printer(int64_t total) {
    const bool tty = isatty(STDERR_FILENO) != 0;
    auto last_tenth = std::make_shared<int64_t>(-1);
    return [tty, total, last_tenth](int64_t done) {
        const int64_t t = total > 0 ? total : 1;
        const int64_t tenth = std::min<int64_t>(10, done * 10 / t);
        const double mib = 1.0 / (1024.0 * 1024.0);
        if (tty) {
            constexpr int64_t kWidth = 30;
            const int64_t filled = std::min(kWidth, done * kWidth / t);
            std::fprintf(stderr, "\rUploading weights to the GPU: [%s%s] %.0f/%.0f MiB\x1b[K",
                         std::string(static_cast<size_t>(filled), '#').c_str(),
                         std::string(static_cast<size_t>(kWidth - filled), ' ').c_str(), static_cast<double>(done) * mib,
                         static_cast<double>(total) * mib);
            if (done >= total) std::fputc('\n', stderr);
        } else if (tenth > *last_tenth) {
            *last_tenth = tenth;
            std::fprintf(stderr, "Uploading weights to the GPU: %.0f/%.0f MiB\n", static_cast<double>(done) * mib,
                         static_cast<double>(total) * mib);
        }
        std::fflush(stderr);
    };
}

}  // namespace memra::cli
