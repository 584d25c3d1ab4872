// The Xxh3Stream functions, compiled once per target: included after
// third_party/xxhash.h (XXH_INLINE_ALL) by xxh3_avx2.cpp and by
// xxh3_dispatch.h, in an unnamed namespace so the two builds never merge.
// They reproduce XXH3_64bits (seed 0, default secret) exactly; the tests
// compare against python-xxhash for every length and cut.
#pragma once

#include <algorithm>
#include <cstring>

#include "xxh3_stream.h"

namespace wsync {
namespace {

constexpr size_t kStripe = XXH_STRIPE_LEN;                                    // 64
constexpr size_t kPerBlock = (sizeof(XXH3_kSecret) - kStripe) / XXH_SECRET_CONSUME_RATE;  // 16 stripes

inline void xs_reset(Xxh3Stream* st, uint64_t len) {
  static const uint64_t init[8] = {XXH_PRIME32_3, XXH_PRIME64_1, XXH_PRIME64_2, XXH_PRIME64_3,
                                   XXH_PRIME64_4, XXH_PRIME32_2, XXH_PRIME64_5, XXH_PRIME32_1};
  std::memcpy(st->acc, init, sizeof(init));
  st->len = len;
  st->seen = st->stripes = st->fill = 0;
}

// Accumulate m whole stripes at p, the k-th onwards, scrambling after every block of kPerBlock.
XXH_FORCE_INLINE void xs_stripes(xxh_u64* acc, const uint8_t* p, uint64_t m, uint64_t& k) {
  const uint8_t* secret = XXH3_kSecret;
  while (m) {
    const uint64_t in_block = k % kPerBlock;
    if (in_block == 0 && m >= kPerBlock) {  // a whole block: the unrolled loop of one-shot xxh3
      XXH3_accumulate(acc, p, secret, kPerBlock, XXH3_accumulate_512);
      XXH3_scrambleAcc(acc, secret + sizeof(XXH3_kSecret) - kStripe);
      p += kPerBlock * kStripe;
      m -= kPerBlock;
      k += kPerBlock;
      continue;
    }
    const uint64_t c = std::min<uint64_t>(kPerBlock - in_block, m);
    XXH3_accumulate(acc, p, secret + in_block * XXH_SECRET_CONSUME_RATE, size_t(c), XXH3_accumulate_512);
    p += c * kStripe;
    m -= c;
    k += c;
    if (k % kPerBlock == 0) XXH3_scrambleAcc(acc, secret + sizeof(XXH3_kSecret) - kStripe);
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
  XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[8];  // in registers for the whole call (gcc spills them if kept in st)
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
  if (st->len <= 240) return XXH3_64bits(st->small, size_t(st->len));
  XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[8];
  std::memcpy(acc, st->acc, sizeof(acc));
  XXH3_accumulate_512(acc, st->last, XXH3_kSecret + sizeof(XXH3_kSecret) - kStripe - XXH_SECRET_LASTACC_START);
  return XXH3_mergeAccs(acc, XXH3_kSecret + XXH_SECRET_MERGEACCS_START, st->len * XXH_PRIME64_1);
}

}  // namespace
}  // namespace wsync
