// ThreadPool: persistent workers woken per parallel_for by a generation counter (see thread_pool.h).
//
// A decode step is ~140 small ops, each a parallel_for of a few microseconds, so sleeping on a condition
// variable between ops costs more than the ops (a futex wake per worker and a context switch each way).
// Workers and the caller therefore spin on atomics for a short while (kSpin) before they sleep: back to
// back ops find the workers awake, and an idle pool still falls asleep within kSpin. The mutex and the
// condition variables are only for sleeping; a sleeper is always woken (the sleeper counts and the state
// they guard change under the mutex, so no wake-up is lost).
#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "core/check.h"

namespace memra {
namespace {

// How long a worker waits awake for the next job, and the caller for the workers, before sleeping.
constexpr std::chrono::microseconds kSpin{100};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// Spins until done() or kSpin has passed; true when done() held. Between rounds of polling it yields the
// core, so that with more threads than cores the thread it waits for gets to run.
template <class Done>
bool spin_until(const Done &done) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    for (;;) {
        for (int i = 0; i < 32; ++i) {
            if (done()) return true;
            cpu_relax();
        }
        if (std::chrono::steady_clock::now() >= deadline) return done();
        std::this_thread::yield();
    }
}

}  // namespace

struct ThreadPool::State {
    int n_threads = 1;
    std::vector<std::thread> workers;
    std::atomic<uint64_t> generation{0};  // bumped once per parallel_for; workers run each generation once
    std::atomic<int> pending{0};          // workers still running the current generation
    std::atomic<bool> stopping{false};
    // The current job, written before generation is bumped (release) and read after it is seen (acquire):
    // ranges [i * chunk, min(n, (i + 1) * chunk)) for i = 0 .. n_threads-1.
    // Dynamic jobs (parallel_for_dynamic): every thread claims ranges of `chunk` from `next_index` until none is left.
    const FunctionRef<void(int64_t, int64_t)> *fn = nullptr;
    int64_t n = 0;
    int64_t chunk = 0;
    bool dynamic = false;
    std::atomic<int64_t> next_index{0};

    std::mutex mutex;
    std::condition_variable wake;  // sleeping workers: a new generation or stopping
    std::condition_variable done;  // a sleeping caller: pending reached 0
    int sleeping_workers = 0;      // guarded by mutex
    bool caller_sleeping = false;  // guarded by mutex

    void run_range(int i) {
        if (dynamic) {
            for (;;) {
                const int64_t begin = next_index.fetch_add(chunk, std::memory_order_relaxed);
                if (begin >= n) return;
                (*fn)(begin, std::min(n, begin + chunk));
            }
        }
        const int64_t begin = std::min(n, int64_t{i} * chunk);
        const int64_t end = std::min(n, begin + chunk);
        if (begin < end) (*fn)(begin, end);
    }

    // Runs the job set up in fn / n / chunk / dynamic on every thread and returns when all have finished it.
    void run_job() {
        pending.store(static_cast<int>(workers.size()), std::memory_order_relaxed);
        generation.fetch_add(1, std::memory_order_acq_rel);
        {
            std::lock_guard lock(mutex);
            if (sleeping_workers > 0) wake.notify_all();
        }
        run_range(0);
        auto finished = [&] { return pending.load(std::memory_order_acquire) == 0; };
        if (!spin_until(finished)) {
            std::unique_lock lock(mutex);
            caller_sleeping = true;
            done.wait(lock, finished);
            caller_sleeping = false;
        }
        fn = nullptr;
    }

    // Returns the next generation after `seen`, or seen when stopping.
    uint64_t wait_for_job(uint64_t seen) {
        auto moved = [&] {
            return generation.load(std::memory_order_acquire) != seen || stopping.load(std::memory_order_acquire);
        };
        if (!spin_until(moved)) {
            std::unique_lock lock(mutex);
            ++sleeping_workers;
            wake.wait(lock, moved);
            --sleeping_workers;
        }
        return stopping.load(std::memory_order_acquire) ? seen : generation.load(std::memory_order_acquire);
    }

    void worker_loop(int index) {
        uint64_t seen = 0;
        for (;;) {
            const uint64_t next = wait_for_job(seen);
            if (next == seen) return;  // stopping
            seen = next;
            run_range(index);
            if (pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard lock(mutex);
                if (caller_sleeping) done.notify_one();
            }
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
        state_->stopping.store(true, std::memory_order_release);
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
    State &s = *state_;
    s.fn = &fn;
    s.n = n;
    s.chunk = (n + ranges - 1) / ranges;
    s.dynamic = false;
    s.run_job();
}

void ThreadPool::parallel_for_dynamic(int64_t n, FunctionRef<void(int64_t, int64_t)> fn, int64_t grain) {
    if (n <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    if (state_->n_threads == 1 || n <= grain) {
        fn(0, n);
        return;
    }
    State &s = *state_;
    s.fn = &fn;
    s.n = n;
    s.chunk = grain;
    s.dynamic = true;
    s.next_index.store(0, std::memory_order_relaxed);
    s.run_job();
}

}  // namespace memra
