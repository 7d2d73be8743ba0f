// Shard progress on stderr while a checkpoint is mapped and validated: a single self-rewriting
// line when stderr is a terminal, otherwise one line per shard (USERS.md section 4).
#pragma once

#include <cstdint>
#include <functional>

#include "io/safetensors.h"

namespace memra::cli {

io::ShardProgress shard_progress_printer();

// Weight upload progress on stderr (a GPU backend's uploads): called with the bytes uploaded so far of `total`;
// a self-rewriting bar on a terminal, else a line at every tenth. Ends its line at total.
std::function<void(int64_t done)> upload_progress_printer(int64_t total);

}  // namespace memra::cli
