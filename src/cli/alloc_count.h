// The memra executable's heap allocation count: alloc_count.cpp replaces the global operator new / delete
// with versions that count every allocation (and only count: each forwards to malloc / free). `memra
// verify` reads the count around every step to show that the hot path allocates nothing
// (ARCHITECTURE.md "Hot-path rules"); nothing else in the program depends on it.
#pragma once

#include <cstdint>

namespace memra::cli {

// Allocations through any operator new since the process started (every thread).
int64_t heap_allocations();

}  // namespace memra::cli
