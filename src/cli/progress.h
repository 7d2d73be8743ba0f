// Shard progress on stderr while a checkpoint is mapped and validated: a single self-rewriting
// line when stderr is a terminal, otherwise one line per shard (USERS.md section 4).
#pragma once

#include "io/safetensors.h"

namespace memra::cli {

io::ShardProgress shard_progress_printer();

}  // namespace memra::cli
