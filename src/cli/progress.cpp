// Shard progress printer (see progress.h).
#include "cli/progress.h"

#include <cstdio>
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

}  // namespace memra::cli
