// The block-tree checksum of wsync/checksum.py: xxh3-64 of the concatenated
// little-endian xxh3-64 digests of each 1 MiB block. The tree exists so blocks
// can be hashed independently; here the threads of parallel.h share them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "streams.h"
#include "xxh3_dispatch.h"

namespace wsync {

constexpr int64_t kBlock = int64_t(1) << 20;  // checksum.BLOCK

inline int64_t nblocks(int64_t nbytes) { return (nbytes + kBlock - 1) / kBlock; }

// The root of the tree from its leaves. The host is little-endian
// (delta_kernels.h refuses others), so the digest array's bytes are already
// the "<u8" concatenation the reference hashes.
inline uint64_t combine_digests(const std::vector<uint64_t>& digests) {
  return xxh3(digests.data(), digests.size() * sizeof(uint64_t));
}

// Feed stream bytes [lo, hi) to h, all their pieces in batches.
inline void hash_range(const Stream& s, int64_t lo, int64_t hi, BlockHash& h) {
  SpanBatch batch(&h);
  for_pieces(s, lo, hi, [&](uintptr_t b, int64_t l, int64_t r) { batch.add(at(b, l), r - l); });
}

// The xxh3 of stream bytes [lo, hi): one shot when they lie in one piece, else streamed over the pieces.
inline uint64_t hash_block(const Stream& s, int64_t lo, int64_t hi) {
  const int64_t i = s.find(lo);
  if (i < s.n && s.starts[i + 1] >= hi) return xxh3(at(s.base(i), lo), size_t(hi - lo));
  BlockHash h(hi - lo);
  hash_range(s, lo, hi, h);
  return h.digest();
}

inline uint64_t tree_checksum(const Stream& s) {
  const int64_t n = s.bytes(), nb = nblocks(n);
  std::vector<uint64_t> digests(static_cast<size_t>(nb), 0);
  parallel_for(nb, 1, [&](int64_t i) { digests[i] = hash_block(s, i * kBlock, std::min(n, (i + 1) * kBlock)); });
  return combine_digests(digests);
}

// dst = src (streams of one size, cut anywhere), and the checksum of the bytes,
// in one pass: each 1 MiB block is hashed from dst right after it is copied,
// while it is in cache.
inline uint64_t copy_tree_checksum(const Stream& src, const Stream& dst) {
  const int64_t n = src.bytes(), nb = nblocks(n);
  std::vector<uint64_t> digests(static_cast<size_t>(nb), 0);
  parallel_for(nb, 1, [&](int64_t i) {
    const int64_t lo = i * kBlock, hi = std::min(n, lo + kBlock);
    zip_pieces(src, dst, lo, hi, [&](uintptr_t s, uintptr_t d, int64_t l, int64_t r) {
      std::memcpy(at(d, l), at(s, l), size_t(r - l));
    });
    digests[i] = hash_block(dst, lo, hi);
  });
  return combine_digests(digests);
}

}  // namespace wsync
