// FunctionRef refers to a callable without copying it, so passing a lambda with any amount of capture to
// the thread pool (or a rank group) allocates nothing.
#include <array>
#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "alloc_counter.h"
#include "core/function_ref.h"
#include "core/thread_pool.h"

namespace memra {
namespace {

struct CopyCounter {
    int *copies;
    int calls = 0;
    CopyCounter(const CopyCounter &o) : copies(o.copies), calls(o.calls) { ++*copies; }
    explicit CopyCounter(int *c) : copies(c) {}
    int operator()(int x) {
        ++calls;
        return 2 * x;
    }
};

int call_twice(FunctionRef<int(int)> f, int x) { return f(f(x)); }

TEST(FunctionRef, CallsTheReferencedObjectWithoutCopyingIt) {
    int copies = 0;
    CopyCounter c(&copies);
    EXPECT_EQ(call_twice(c, 3), 12);
    EXPECT_EQ(copies, 0);
    EXPECT_EQ(c.calls, 2);  // the caller's object ran, not a copy
}

TEST(FunctionRef, WrapsConstLambdasFunctionPointersAndReturnsResults) {
    const std::string suffix = "!";
    const auto lambda = [&suffix](const std::string &s) { return s + suffix; };
    FunctionRef<std::string(const std::string &)> f = lambda;
    EXPECT_EQ(f("a"), "a!");
    int (*const square)(int) = [](int x) { return x * x; };
    EXPECT_EQ(call_twice(square, 3), 81);
}

TEST(FunctionRef, ThreadPoolJobsWithLargeCapturesDoNotAllocate) {
    ThreadPool pool(3);
    std::array<int64_t, 64> out{};
    int64_t a = 1, b = 2, c = 3, d = 4, e = 5;  // five captured references: over std::function's inline buffer
    auto job = [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) out[static_cast<size_t>(i)] = a + b + c + d + e + i;
    };
    pool.parallel_for(64, job);  // warm-up
    const int64_t before = g_allocations.load();
    for (int i = 0; i < 100; ++i) {
        pool.parallel_for(64, [&](int64_t begin, int64_t end) {
            for (int64_t k = begin; k < end; ++k) out[static_cast<size_t>(k)] = a + b + c + d + e + k + i;
        });
    }
    EXPECT_EQ(g_allocations.load() - before, 0);
    EXPECT_EQ(out[63], 15 + 63 + 99);
}

}  // namespace
}  // namespace memra
