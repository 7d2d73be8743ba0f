// Internal helpers of the CPU ops (not part of the op interface): reading a norm weight element in its
// stored dtype, and splitting row loops over the thread pool. The split never changes bits: every row is
// computed by one thread with the same code, whatever the range it falls in (DETERMINISM.md D5).
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/dtype.h"
#include "core/float_formats.h"
#include "core/thread_pool.h"

namespace memra::cpu::detail {

// Exact f32 value of element i of a [n] f32 or bf16 vector (the caller has checked the dtype).
inline float load_f32_or_bf16(const void *data, DType dtype, int64_t i) {
    if (dtype == DType::kF32) return static_cast<const float *>(data)[i];
    return bf16_to_f32(static_cast<const uint16_t *>(data)[i]);
}

// Runs fn(begin, end) over disjoint ranges of [0, n_rows) on the pool. row_cost (roughly the floats a row
// touches) only sets the grain, so that tiny ops stay on the calling thread.
template <class Fn>
void parallel_rows(ThreadPool &pool, int64_t n_rows, int64_t row_cost, const Fn &fn) {
    constexpr int64_t kMinWorkPerRange = 1 << 14;
    const int64_t grain = std::max<int64_t>(1, kMinWorkPerRange / std::max<int64_t>(row_cost, 1));
    pool.parallel_for(n_rows, fn, grain);
}

}  // namespace memra::cpu::detail
