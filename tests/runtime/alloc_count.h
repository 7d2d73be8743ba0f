// Allocations made so far by this test executable: tests/alloc_counter.h's counting operators live in
// alloc_count.cpp alone, so the test sources that read the count do not inline them.
#pragma once

#include <cstdint>

namespace memra::test {

int64_t allocation_count();

}  // namespace memra::test
