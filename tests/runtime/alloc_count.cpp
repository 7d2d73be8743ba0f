// The one source file of memra_runtime_tests that includes the counting allocator (alloc_count.h).
#include "runtime/alloc_count.h"

#include "alloc_counter.h"

namespace memra::test {

int64_t allocation_count() { return g_allocations.load(); }

}  // namespace memra::test
