// The block-tree checksum of wsync/checksum.py: xxh3-64 of the concatenated
// little-endian xxh3-64 digests of each 1 MiB block. The tree exists so blocks
// can be hashed independently; here the threads of parallel.h share them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
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

inline uint64_t tree_checksum(const uint8_t* p, int64_t n) {
  const int64_t nb = nblocks(n);
  std::vector<uint64_t> digests(static_cast<size_t>(nb), 0);
  parallel_for(nb, 1, [&](int64_t i) {
    digests[i] = xxh3(p + i * kBlock, size_t(std::min(kBlock, n - i * kBlock)));
  });
  return combine_digests(digests);
}

// dst = src, and the checksum of the bytes, in one pass: each 1 MiB block is
// hashed from dst right after it is copied, while it is in cache.
inline uint64_t copy_tree_checksum(const uint8_t* src, uint8_t* dst, int64_t n) {
  const int64_t nb = nblocks(n);
  std::vector<uint64_t> digests(static_cast<size_t>(nb), 0);
  parallel_for(nb, 1, [&](int64_t i) {
    const size_t len = size_t(std::min(kBlock, n - i * kBlock));
    std::memcpy(dst + i * kBlock, src + i * kBlock, len);
    digests[i] = xxh3(dst + i * kBlock, len);
  });
  return combine_digests(digests);
}

}  // namespace wsync
