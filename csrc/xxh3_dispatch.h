// xxh3 for the kernels: the baseline (SSE2) build inlined here, or the AVX2
// build of xxh3_avx2.cpp when the CPU supports it; both give the same digests.
#pragma once

#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL  // header-only: no libxxhash to link, and the compiler can inline XXH3
#include "third_party/xxhash.h"
#include "xxh3_avx2.h"

namespace wsync {

inline bool use_avx2() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool yes = avx2::compiled() && __builtin_cpu_supports("avx2");
  return yes;
#else
  return false;
#endif
}

inline uint64_t xxh3(const void* p, size_t n) { return use_avx2() ? avx2::hash(p, n) : XXH3_64bits(p, n); }

// Streaming xxh3 of one checksum block, fed piece by piece (same digest as one shot).
struct BlockHash {
  XXH3_state_t state;
  BlockHash() {
    if (use_avx2()) avx2::reset(&state);
    else XXH3_64bits_reset(&state);
  }
  void add(const uint8_t* p, int64_t len) {
    if (use_avx2()) avx2::update(&state, p, size_t(len));
    else XXH3_64bits_update(&state, p, size_t(len));
  }
  uint64_t digest() const { return use_avx2() ? avx2::digest(&state) : XXH3_64bits_digest(&state); }
};

}  // namespace wsync
