// The Xxh3Stream functions, compiled once per target: included by xxh3_avx2.cpp
// (AVX2) and by xxh3_dispatch.h (baseline), in an unnamed namespace over
// xxh3.h's static functions, so the two builds never merge. They reproduce
// XXH3_64bits (seed 0, default secret) exactly; the tests compare against
// python-xxhash for every length and cut.
#pragma once

#include <algorithm>
#include <cstring>

#include "xxh3.h"
#include "xxh3_stream.h"

namespace wsync {
namespace {

constexpr uint64_t kStripe = ws::XXH3_STRIPE;                          // 64
constexpr uint64_t kPerBlock = uint64_t(ws::XXH3_STRIPES);             // 16 stripes between scrambles

inline void xs_reset(Xxh3Stream* st, uint64_t len) {
  ws::u64 acc[8];  // xxh3.h's u64 is unsigned long long, the stream's uint64_t may be unsigned long
  ws::xxh3_init_acc(acc);
  std::memcpy(st->acc, acc, sizeof(acc));
  st->len = len;
  st->seen = st->stripes = st->fill = 0;
}

// Accumulate m whole stripes at p, the k-th onwards, scrambling after every block of kPerBlock.
inline __attribute__((always_inline)) void xs_stripes(ws::u64* acc, const uint8_t* p, uint64_t m, uint64_t& k) {
  const uint8_t* secret = ws::xxh3_secret_host;
  while (m) {
    const uint64_t in_block = k % kPerBlock;
    if (in_block == 0 && m >= kPerBlock) {  // whole blocks: the unrolled loop of one-shot xxh3
      const uint64_t nb = m / kPerBlock;
      ws::xxh3_blocks(acc, p, nb);
      p += nb * kPerBlock * kStripe;
      m -= nb * kPerBlock;
      k += nb * kPerBlock;
      continue;
    }
    const uint64_t c = std::min<uint64_t>(kPerBlock - in_block, m);
    ws::xxh3_accumulate(acc, p, secret + in_block * 8, c);
    p += c * kStripe;
    m -= c;
    k += c;
    if (k % kPerBlock == 0) ws::xxh3_scramble_acc(acc, secret + ws::XXH3_SCRAMBLE_KEY);
  }
}

// Feed spans in stream order; their bytes must not exceed the length given to reset.
inline void xs_feed(Xxh3Stream* st, const Span* spans, size_t count) {
  const uint64_t len = st->len;
  if (len <= 240) {
    for (size_t i = 0; i < count; ++i) {
      if (spans[i].n <= 0) continue;
      std::memcpy(st->small + st->seen, spans[i].p, size_t(spans[i].n));
      st->seen += uint64_t(spans[i].n);
    }
    return;
  }
  const uint64_t total = (len - 1) / kStripe, tail = len - kStripe;
  alignas(32) ws::u64 acc[8];  // in registers for the whole call (gcc spills them if kept in st)
  std::memcpy(acc, st->acc, sizeof(acc));
  uint64_t k = st->stripes, fill = st->fill, seen = st->seen;
  for (size_t i = 0; i < count; ++i) {
    const uint8_t* p = spans[i].p;
    uint64_t n = spans[i].n > 0 ? uint64_t(spans[i].n) : 0;
    if (!n) continue;
    const uint64_t start = seen;
    seen += n;
    if (seen > tail) {  // some of the last 64 bytes are here
      const uint64_t from = std::max(start, tail);
      std::memcpy(st->last + (from - tail), p + (from - start), size_t(seen - from));
    }
    if (k >= total) continue;
    if (fill) {
      const uint64_t t = std::min<uint64_t>(kStripe - fill, n);
      std::memcpy(st->carry + fill, p, size_t(t));
      fill += t;
      p += t;
      n -= t;
      if (fill < kStripe) continue;
      xs_stripes(acc, st->carry, 1, k);
      fill = 0;
    }
    const uint64_t whole = std::min<uint64_t>(n / kStripe, total - k);
    xs_stripes(acc, p, whole, k);
    p += whole * kStripe;
    n -= whole * kStripe;
    if (k < total && n) {  // n < 64 here: the start of a stripe the next span finishes
      std::memcpy(st->carry, p, size_t(n));
      fill = n;
    }
  }
  std::memcpy(st->acc, acc, sizeof(acc));
  st->stripes = k;
  st->fill = fill;
  st->seen = seen;
}

// The digest, once all len bytes were fed.
inline uint64_t xs_digest(const Xxh3Stream* st) {
  if (st->len <= 240) return ws::xxh3_short(st->small, st->len);
  alignas(32) ws::u64 acc[8];
  std::memcpy(acc, st->acc, sizeof(acc));
  return ws::xxh3_finish(acc, st->last, st->len);
}

}  // namespace
}  // namespace wsync
