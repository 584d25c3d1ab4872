// xxh3 compiled for AVX2, picked at run time by xxh3_dispatch.h on CPUs that
// have it. The fused kernels hash every byte of two tensors, and SSE2 xxh3 is
// compute-bound at about 11 GB/s per core, below what memory delivers; AVX2
// roughly doubles it. A separate translation unit keeps the rest of the module
// baseline x86-64, so one build runs on any x86-64 CPU.
//
// This file must define no inline or template function that another
// translation unit also defines: the linker keeps one copy of such functions,
// and the AVX2 copy would then run on CPUs without AVX2. xxh3.h gives all of
// its host functions internal linkage (static), so it is safe to include.
#include <cstddef>
#include <cstdint>

#if defined(__GNUC__) && defined(__x86_64__)
#pragma GCC target("avx2")
#include <immintrin.h>
#define WS_XXH3_AVX2 1  // xxh3.h's AVX2 accumulators (the pragma does not define __AVX2__)
// Leave the upper halves of the ymm registers clean on return: SSE code that
// runs after dirty AVX state pays a penalty on every instruction.
#define CLEAN_UPPER() _mm256_zeroupper()
#else
#define CLEAN_UPPER() (void)0
#endif

#include "xxh3.h"
#include "xxh3_avx2.h"
#include "xxh3_stream_impl.h"

namespace wsync {
namespace avx2 {

bool compiled() {
#ifdef WS_XXH3_AVX2
  return true;
#else
  return false;
#endif
}

uint64_t hash(const void* p, size_t n) {
  const uint64_t h = ws::xxh3_64(p, n);
  CLEAN_UPPER();
  return h;
}

void stream_reset(Xxh3Stream* st, uint64_t len) { xs_reset(st, len); }

void stream_feed(Xxh3Stream* st, const Span* spans, size_t count) {
  xs_feed(st, spans, count);
  CLEAN_UPPER();
}

uint64_t stream_digest(const Xxh3Stream* st) {
  const uint64_t h = xs_digest(st);
  CLEAN_UPPER();
  return h;
}

}  // namespace avx2
}  // namespace wsync
