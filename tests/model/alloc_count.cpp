// The one source file of memra_model_tests that includes the counting allocator (alloc_count.h).
#include "model/alloc_count.h"

#include "alloc_counter.h"

namespace memra::test {

int64_t allocation_count() { return g_allocations.load(); }

}  // namespace memra::test
