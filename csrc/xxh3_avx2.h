// The AVX2 build of xxh3 (xxh3_avx2.cpp). Declarations only, and states passed
// as void*: nothing here may be compiled twice with different targets.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wsync {
namespace avx2 {
bool compiled();
uint64_t hash(const void* p, size_t n);
void reset(void* state);  // an XXH3_state_t
void update(void* state, const void* p, size_t n);
uint64_t digest(const void* state);
}  // namespace avx2
}  // namespace wsync
