// The AVX2 build of xxh3 (xxh3_avx2.cpp). Declarations only, and states passed
// as void*: nothing here may be compiled twice with different targets.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xxh3_stream.h"

namespace wsync {
namespace avx2 {
bool compiled();
uint64_t hash(const void* p, size_t n);
void stream_reset(Xxh3Stream* st, uint64_t len);
void stream_feed(Xxh3Stream* st, const Span* spans, size_t count);
uint64_t stream_digest(const Xxh3Stream* st);
}  // namespace avx2
}  // namespace wsync
