// Counting replacements of every global operator new / delete for the memra executable (alloc_count.h).
// The replaced operators are global by the language's definition, so the count they bump is a
// process-wide atomic: the one global of the CLI, documented here. Every variant forwards to malloc /
// aligned_alloc / free, so sanitizers see matching pairs; neither the news nor the deletes are inlined, so
// g++ never pairs a visible malloc() or free() with a delete- or new-expression (-Wmismatched-new-delete).
#include "cli/alloc_count.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {

std::atomic<int64_t> g_heap_allocations{0};

void *counted(std::size_t size) {
    g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
    return std::malloc(size == 0 ? 1 : size);
}

void *counted_aligned(std::size_t size, std::align_val_t align) {
    g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
    const auto a = static_cast<std::size_t>(align);
    const std::size_t rounded = (size + a - 1) / a * a;  // aligned_alloc wants a multiple of the alignment
    return std::aligned_alloc(a, rounded == 0 ? a : rounded);
}

}  // namespace

namespace memra::cli {

int64_t heap_allocations() { return g_heap_allocations.load(std::memory_order_relaxed); }

}  // namespace memra::cli

[[gnu::noinline]] void *operator new(std::size_t size) {
    if (void *p = counted(size)) return p;
    throw std::bad_alloc();
}
[[gnu::noinline]] void *operator new[](std::size_t size) {
    if (void *p = counted(size)) return p;
    throw std::bad_alloc();
}
[[gnu::noinline]] void *operator new(std::size_t size, const std::nothrow_t &) noexcept { return counted(size); }
[[gnu::noinline]] void *operator new[](std::size_t size, const std::nothrow_t &) noexcept { return counted(size); }
[[gnu::noinline]] void *operator new(std::size_t size, std::align_val_t align) {
    if (void *p = counted_aligned(size, align)) return p;
    throw std::bad_alloc();
}
[[gnu::noinline]] void *operator new[](std::size_t size, std::align_val_t align) {
    if (void *p = counted_aligned(size, align)) return p;
    throw std::bad_alloc();
}
[[gnu::noinline]] void *operator new(std::size_t size, std::align_val_t align, const std::nothrow_t &) noexcept {
    return counted_aligned(size, align);
}
[[gnu::noinline]] void *operator new[](std::size_t size, std::align_val_t align, const std::nothrow_t &) noexcept {
    return counted_aligned(size, align);
}
[[gnu::noinline]] void operator delete(void *p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void *p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void *p, const std::nothrow_t &) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p, const std::nothrow_t &) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void *p, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void *p, std::size_t, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p, std::size_t, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void *p, std::align_val_t, const std::nothrow_t &) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void *p, std::align_val_t, const std::nothrow_t &) noexcept { std::free(p); }
