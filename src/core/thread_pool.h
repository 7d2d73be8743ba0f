// A fixed pool of worker threads for the CPU backend. Work is split into contiguous index ranges;
// every output element is computed by exactly one thread in its op's fixed order, so results never
// depend on the thread count (DETERMINISM.md D5). No allocation per call. Between jobs the workers stay
// awake for ~100 us (polling, yielding the core) before they sleep, so the ~140 small ops of a decode
// step do not each pay a sleep and a wake-up.
#pragma once

#include <cstdint>
#include "core/function_ref.h"

namespace memra {

class ThreadPool {
public:
    // n_threads >= 1 (MEMRA_CHECK); 1 runs everything on the calling thread.
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool &) = delete;
    ThreadPool &operator=(const ThreadPool &) = delete;

    int n_threads() const;

    // Calls fn(begin, end) on disjoint contiguous ranges covering [0, n) (at most n_threads ranges,
    // each at least `grain` long except possibly the last) and returns when all are done. The calling
    // thread takes part. Not reentrant: fn must not call parallel_for on the same pool.
    void parallel_for(int64_t n, FunctionRef<void(int64_t begin, int64_t end)> fn, int64_t grain = 1);
    // The same for work of uneven cost (causal attention, experts of different loads): the threads claim
    // ranges of `grain` indices in turn until none is left, so which thread runs an index varies from call
    // to call; only for fn whose result for an index does not depend on the range it came in.
    void parallel_for_dynamic(int64_t n, FunctionRef<void(int64_t begin, int64_t end)> fn, int64_t grain);

private:
    struct State;
    State *state_;
};

}  // namespace memra
