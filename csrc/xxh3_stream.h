// XXH3-64 of a byte stream of known length fed in spans: the state, shared by
// the baseline and AVX2 translation units. Plain data only (no inline or
// template code here: see xxh3_avx2.cpp).
//
// Why not a generic streaming update (xxhash's XXH3_64bits_update): a 1 MiB
// checksum block of a many-tensor segment arrives as hundreds of small
// pieces, and every update call copies the
// accumulators in and out and moves up to 256 bytes through xxhash's buffer
// (perf: memmove was 23% of a block's hashing at 2 KiB pieces). Knowing the
// length up front, every whole 64-byte stripe is hashed where it lies, the
// accumulators stay in registers across all the spans of a call, whole
// 1 KiB blocks take xxh3.h's whole-block loop (xxh3_blocks), and only a
// stripe that straddles two spans is copied.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wsync {

struct Span {
  const uint8_t* p;
  int64_t n;
};

struct Xxh3Stream {
  alignas(64) uint64_t acc[8];
  uint8_t carry[64];   // a stripe straddling two spans, being filled (fill bytes so far)
  uint8_t last[64];    // the stream's last 64 bytes, kept as they pass (xxh3's final stripe)
  uint8_t small[240];  // the whole stream when len <= 240 (xxh3's short-input paths)
  uint64_t len;        // total bytes, fixed at reset
  uint64_t seen;       // bytes fed so far
  uint64_t stripes;    // stripes accumulated (xxh3 accumulates (len - 1) / 64 before the final one)
  uint64_t fill;
};

}  // namespace wsync
