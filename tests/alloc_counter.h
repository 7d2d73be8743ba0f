// Counting replacements of every global operator new / delete, for the tests that show a hot path
// allocates nothing (ARCHITECTURE.md "Hot-path rules"). Include it from exactly one source file of a
// test executable; read g_allocations before and after the code under test. All variants forward to
// malloc/free, so sanitizers see matching pairs. Neither the news nor the deletes are inlined, so g++ never
// pairs a malloc() or free() it can see with a delete- or new-expression at the call site
// (-Wmismatched-new-delete; g++ 13 pairs an inlined malloc with std::allocator's sized delete).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace {

// The replacement operators are global by definition, so the counter they bump has to be too.
std::atomic<int64_t> g_allocations{0};

void *counted_malloc(std::size_t size) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    return std::malloc(size == 0 ? 1 : size);
}

void *counted_aligned(std::size_t size, std::align_val_t align) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    const auto a = static_cast<std::size_t>(align);
    const std::size_t rounded = (size + a - 1) / a * a;
    return std::aligned_alloc(a, rounded == 0 ? a : rounded);
}

}  // namespace

[[gnu::noinline]] void *operator new(std::size_t size) {
    if (void *p = counted_malloc(size)) return p;
    throw std::bad_alloc();
}
[[gnu::noinline]] void *operator new[](std::size_t size) { return ::operator new(size); }
[[gnu::noinline]] void *operator new(std::size_t size, const std::nothrow_t &) noexcept { return counted_malloc(size); }
[[gnu::noinline]] void *operator new[](std::size_t size, const std::nothrow_t &) noexcept { return counted_malloc(size); }
[[gnu::noinline]] void *operator new(std::size_t size, std::align_val_t align) {
    if (void *p = counted_aligned(size, align)) return p;
    throw std::bad_alloc();
}
[[gnu::noinline]] void *operator new[](std::size_t size, std::align_val_t align) { return ::operator new(size, align); }
[[gnu::noinline]] void operator delete(void *p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void *p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void *p, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void *p, std::size_t, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p, std::size_t, std::align_val_t) noexcept { std::free(p); }

