// ThreadPool: persistent workers woken per parallel_for by a generation counter (see thread_pool.h).
#include "core/thread_pool.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "core/check.h"

namespace memra {

struct ThreadPool::State {
    int n_threads = 1;
    std::vector<std::thread> workers;
    std::mutex mutex;
    std::condition_variable wake;
    std::condition_variable done;
    uint64_t generation = 0;  // bumped once per parallel_for; workers run each generation once
    bool stopping = false;
    int pending = 0;  // workers still running the current generation
    // The current job: ranges [i * chunk, min(n, (i + 1) * chunk)) for i = 0 .. n_threads-1.
    const FunctionRef<void(int64_t, int64_t)> *fn = nullptr;
    int64_t n = 0;
    int64_t chunk = 0;

    void run_range(int i) const {
        const int64_t begin = std::min(n, int64_t{i} * chunk);
        const int64_t end = std::min(n, begin + chunk);
        if (begin < end) (*fn)(begin, end);
    }

    void worker_loop(int index) {
        uint64_t seen = 0;
        for (;;) {
            std::unique_lock lock(mutex);
            wake.wait(lock, [&] { return stopping || generation != seen; });
            if (stopping) return;
            seen = generation;
            lock.unlock();
            run_range(index);
            lock.lock();
            if (--pending == 0) done.notify_one();
        }
    }
};

ThreadPool::ThreadPool(int n_threads) : state_(new State) {
    MEMRA_CHECK(n_threads >= 1, "thread pool needs at least 1 thread, got {}", n_threads);
    state_->n_threads = n_threads;
    for (int i = 1; i < n_threads; ++i) {
        state_->workers.emplace_back([this, i] { state_->worker_loop(i); });
    }
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard lock(state_->mutex);
        state_->stopping = true;
    }
    state_->wake.notify_all();
    for (std::thread &t : state_->workers) t.join();
    delete state_;
}

int ThreadPool::n_threads() const { return state_->n_threads; }

void ThreadPool::parallel_for(int64_t n, FunctionRef<void(int64_t, int64_t)> fn, int64_t grain) {
    if (n <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    const int64_t max_ranges = std::max<int64_t>(1, n / grain);
    const int ranges = static_cast<int>(std::min<int64_t>(state_->n_threads, max_ranges));
    if (ranges == 1) {
        fn(0, n);
        return;
    }
    {
        std::lock_guard lock(state_->mutex);
        state_->fn = &fn;
        state_->n = n;
        state_->chunk = (n + ranges - 1) / ranges;
        state_->pending = static_cast<int>(state_->workers.size());
        ++state_->generation;
    }
    state_->wake.notify_all();
    state_->run_range(0);
    std::unique_lock lock(state_->mutex);
    state_->done.wait(lock, [&] { return state_->pending == 0; });
    state_->fn = nullptr;
}

}  // namespace memra
