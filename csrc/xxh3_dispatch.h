// xxh3 for the kernels: the baseline (SSE2) build inlined here, or the AVX2
// build of xxh3_avx2.cpp when the CPU supports it; both give the same digests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "xxh3.h"  // wsync's own XXH3 (shared with the CUDA kernels)
#include "xxh3_avx2.h"
#include "xxh3_stream_impl.h"

namespace wsync {

// WSYNC_NO_AVX2=1 runs the baseline build on an AVX2 CPU (the tests check that both give the same digests).
inline bool use_avx2() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool yes = avx2::compiled() && __builtin_cpu_supports("avx2") && !std::getenv("WSYNC_NO_AVX2");
  return yes;
#else
  return false;
#endif
}

inline uint64_t xxh3(const void* p, size_t n) { return use_avx2() ? avx2::hash(p, n) : ws::xxh3_64(p, n); }

// The xxh3 of one checksum block of `len` bytes, fed in order span by span
// (same digest as one shot; see xxh3_stream.h). Feed many spans per call where
// they are known together: the accumulators stay in registers across them.
class BlockHash {
 public:
  explicit BlockHash(int64_t len) {
    if (use_avx2()) avx2::stream_reset(&st_, uint64_t(len));
    else xs_reset(&st_, uint64_t(len));
  }
  void feed(const Span* spans, size_t count) {
    if (use_avx2()) avx2::stream_feed(&st_, spans, count);
    else xs_feed(&st_, spans, count);
  }
  void add(const uint8_t* p, int64_t n) {
    const Span s{p, n};
    feed(&s, 1);
  }
  uint64_t digest() const { return use_avx2() ? avx2::stream_digest(&st_) : xs_digest(&st_); }

 private:
  Xxh3Stream st_;
};

// Spans gathered for one BlockHash and fed in batches: for a range whose bytes
// do not change before flush() (the caller calls it before writing them).
class SpanBatch {
 public:
  explicit SpanBatch(BlockHash* h) : h_(h) {}
  ~SpanBatch() { flush(); }
  void add(const uint8_t* p, int64_t n) {
    if (!h_) return;
    spans_[count_++] = Span{p, n};
    if (count_ == kSpans) flush();
  }
  void flush() {
    if (h_ && count_) h_->feed(spans_, count_);
    count_ = 0;
  }

 private:
  static constexpr size_t kSpans = 64;
  BlockHash* h_;
  Span spans_[kSpans];
  size_t count_ = 0;
};

}  // namespace wsync
