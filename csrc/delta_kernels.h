// Kernels of the delta `sparse` layout specified by wsync/codecs/delta_ref.py.
//
// Pure C++ with no Python in sight: delta_cpu.cpp owns the buffers, the GIL
// and the error messages, so these functions can run with the GIL released
// and be reused by a future non-Python caller. Every function works on one
// 65536-element chunk or loops over chunks on the thread pool of parallel.h;
// chunks never share output, which is what the format's per-chunk table is for.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "checksum_kernels.h"  // xxh3, for the passes that fuse checksums in

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
// The wire format is little-endian and these kernels load it natively; failing
// the build makes setup.py fall back to the reference backend instead.
#error "wsync._cpu supports little-endian hosts only"
#endif

namespace wsync {

constexpr int64_t kChunk = 65536;  // manifest.CHUNK_ELEMS
constexpr int8_t kEscape = -128;   // delta_ref.ESCAPE
enum Order { kFloat = 0, kInt = 1, kUint = 2 };

inline int64_t nchunks(int64_t n) { return (n + kChunk - 1) / kChunk; }
inline int64_t chunk_len(int64_t n, int64_t c) { return std::min(kChunk, n - c * kChunk); }

// Sections are slices of a payload body at arbitrary byte offsets, so every
// multi-byte access goes through memcpy (one unaligned mov on x86 and arm64).
template <class T>
inline T load(const uint8_t* p, int64_t i) {
  T v;
  std::memcpy(&v, p + i * int64_t(sizeof(T)), sizeof(T));
  return v;
}
template <class T>
inline void store(uint8_t* p, int64_t i, T v) {
  std::memcpy(p + i * int64_t(sizeof(T)), &v, sizeof(T));
}

inline int ctz64(uint64_t m) {
#if defined(_MSC_VER) && !defined(__clang__)
  unsigned long i;
  _BitScanForward64(&i, m);
  return int(i);
#else
  return __builtin_ctzll(m);
#endif
}

// ---- monotone key (delta_ref.monotone_key / unkey) -------------------------

template <class T>
constexpr T sign_bit() { return T(T(1) << (8 * sizeof(T) - 1)); }

template <class T, int O>
inline T key(T x) {
  if constexpr (O == kFloat) return (x & sign_bit<T>()) ? T(~x) : T(x | sign_bit<T>());
  else if constexpr (O == kInt) return T(x ^ sign_bit<T>());
  else return x;
}

template <class T, int O>
inline T unkey(T k) {
  if constexpr (O == kFloat) return (k & sign_bit<T>()) ? T(k ^ sign_bit<T>()) : T(~k);
  else if constexpr (O == kInt) return T(k ^ sign_bit<T>());
  else return k;
}

// The i8 step from old to new, or kEscape when the key moved further than 127.
template <class T, int O>
inline int8_t step_of(T o, T n) {
  using S = std::make_signed_t<T>;
  S d = S(T(key<T, O>(n) - key<T, O>(o)));  // wraps modulo 2^(8W), then read as signed
  return (d >= -127 && d <= 127) ? int8_t(d) : kEscape;
}

// The new bits from the old ones and a (non-escape) step; i8 -> T sign-extends.
template <class T, int O>
inline T apply_step(T o, int8_t s) {
  return unkey<T, O>(T(key<T, O>(o) + T(int64_t(s))));
}

// ---- finding changed elements ----------------------------------------------

// Bit i set where byte i of a and b differ, over 64 bytes.
inline uint64_t diff_bytes64(const uint8_t* a, const uint8_t* b) {
#ifdef __SSE2__
  uint64_t eq = 0;
  for (int k = 0; k < 4; ++k) {
    __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * k));
    __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * k));
    eq |= uint64_t(uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)))) << (16 * k);
  }
  return ~eq;
#else
  uint64_t m = 0;
  for (int k = 0; k < 8; ++k) {
    uint64_t x = load<uint64_t>(a, k) ^ load<uint64_t>(b, k);
    // high bit of each byte of t is set iff that byte of x is non-zero
    uint64_t t = (x | ((x & 0x7f7f7f7f7f7f7f7full) + 0x7f7f7f7f7f7f7f7full)) & 0x8080808080808080ull;
    m |= (((t >> 7) * 0x0102040810204080ull) >> 56) << (8 * k);
  }
  return m;
#endif
}

// Fold a per-byte mask into one bit per W-byte element, at the element's first byte.
template <int W>
inline uint64_t element_mask(uint64_t m) {
  if constexpr (W >= 2) m |= m >> 1;
  if constexpr (W >= 4) m |= m >> 2;
  if constexpr (W >= 8) m |= m >> 4;
  constexpr uint64_t first = W == 1 ? ~0ull : W == 2 ? 0x5555555555555555ull
                           : W == 4 ? 0x1111111111111111ull : 0x0101010101010101ull;
  return m & first;
}

// Call f(i) for each i in [begin, end) with a[i] != b[i], in increasing order.
// At RL densities (~1%) most 64-byte blocks are equal and cost one compare.
template <class T, class F>
inline void for_each_change(const uint8_t* a, const uint8_t* b, int64_t begin, int64_t end, F&& f) {
  constexpr int W = sizeof(T);
  constexpr int64_t per = 64 / W;
  int64_t i = begin;
  for (; i + per <= end; i += per) {
    uint64_t m = element_mask<W>(diff_bytes64(a + i * W, b + i * W));
    for (; m; m &= m - 1) f(i + ctz64(m) / W);
  }
  for (; i < end; ++i)
    if (load<T>(a, i) != load<T>(b, i)) f(i);
}

// ---- work units --------------------------------------------------------------

// Chunks are the unit of parallel work; when checksums are fused into a pass,
// the unit grows to one 1 MiB checksum block (a whole number of chunks for
// every width), so each block is hashed while its chunks are still in cache.
struct Units {
  int64_t nc, per, count;  // chunks, chunks per unit, units
  Units(int64_t n, int width, bool blocks)
      : nc(nchunks(n)), per(blocks ? kBlock / (kChunk * width) : 1), count((nc + per - 1) / per) {}
  int64_t first(int64_t u) const { return u * per; }
  int64_t last(int64_t u) const { return std::min(nc, (u + 1) * per); }
  // Bytes of unit u's elements (its checksum block's length), n elements of `width` bytes in all.
  static int64_t bytes(int64_t n, int width, int64_t first, int64_t last) {
    return (std::min(n, last * kChunk) - first * kChunk) * width;
  }
};

// ---- encode ----------------------------------------------------------------

// Pass 1 also writes each chunk's output into a staging slot of kStage
// changes, so at RL densities pass 2 only copies and the tensors are read
// once. Denser chunks overflow their slot and are re-scanned by pass 2.
constexpr int64_t kStage = 4096;

template <class T>
constexpr int64_t slot_bytes() { return kStage * (3 + int64_t(sizeof(T))); }  // gaps u16, steps i8, escapes T

// Count one chunk's changes and escapes, staging them if `slot` is not null.
// The chunk is elements [begin, end) of the streams a and b, which may be cut
// into pieces in different places: it is scanned run by run, each run inside
// one piece of each, with positions global to the stream throughout. Each
// run is fed to the hashes given right after it is scanned, while in cache.
template <class T, int O>
void stage_chunk(const Stream& A, const Stream& B, int64_t begin, int64_t end, uint8_t* slot, uint32_t* cnt,
                 uint32_t* esc, BlockHash* ha, BlockHash* hb) {
  constexpr int W = sizeof(T);
  int64_t k = 0, e = 0, prev = -1;  // prev = -1 makes the first gap its offset
  SpanBatch sa(ha), sb(hb);  // a and b are only read here: their runs are hashed in batches
  zip_pieces(A, B, begin * W, end * W, [&](uintptr_t pa, uintptr_t pb, int64_t lo, int64_t hi) {
    const uint8_t *a = at(pa, 0), *b = at(pb, 0);
    for_each_change<T>(a, b, lo / W, hi / W, [&](int64_t i) {
      const T nv = load<T>(b, i);
      const int8_t s = step_of<T, O>(load<T>(a, i), nv);
      if (slot && k < kStage) {
        store<uint16_t>(slot, k, uint16_t(i - begin - prev - 1));
        slot[2 * kStage + k] = uint8_t(s);
        if (s == kEscape) store<T>(slot + 3 * kStage, e, nv);  // e <= k < kStage
        prev = i - begin;
      }
      ++k;
      e += s == kEscape;
    });
    sa.add(a + lo, hi - lo);
    sb.add(b + lo, hi - lo);
  });
  *cnt = uint32_t(k);
  *esc = uint32_t(e);
}

// Pass 1: the table (counts, then escape counts), staged output, and the
// xxh3 of every 1 MiB block of old and of new where those digests are given.
template <class T, int O>
void encode_pass1(const Stream& a, const Stream& b, int64_t n, uint32_t* table, uint8_t* stage,
                  uint64_t* old_digests, uint64_t* new_digests) {
  constexpr int W = sizeof(T);
  const Units units(n, W, old_digests != nullptr || new_digests != nullptr);
  parallel_for(units.count, 1, [&](int64_t u) {
    const int64_t block = Units::bytes(n, W, units.first(u), units.last(u));
    BlockHash ho(block), hn(block);
    for (int64_t c = units.first(u); c < units.last(u); ++c) {
      const int64_t begin = c * kChunk, len = chunk_len(n, c);
      stage_chunk<T, O>(a, b, begin, begin + len, stage ? stage + c * slot_bytes<T>() : nullptr, &table[c],
                        &table[units.nc + c], old_digests ? &ho : nullptr, new_digests ? &hn : nullptr);
    }
    if (old_digests) old_digests[u] = ho.digest();
    if (new_digests) new_digests[u] = hn.digest();
  });
}

// Re-scan one chunk straight into place. Writes are capped by the counts of
// pass 1, so a `new` that changed in between (another thread) can only make
// this return false, never write out of bounds.
template <class T, int O>
bool rescan_chunk(const Stream& A, const Stream& B, int64_t begin, int64_t end, int64_t cnt, int64_t esc,
                  uint8_t* gaps, int8_t* steps, uint8_t* escapes) {
  constexpr int W = sizeof(T);
  int64_t k = 0, e = 0, prev = -1;
  bool ok = true;
  zip_pieces(A, B, begin * W, end * W, [&](uintptr_t pa, uintptr_t pb, int64_t lo, int64_t hi) {
    const uint8_t *a = at(pa, 0), *b = at(pb, 0);
    for_each_change<T>(a, b, lo / W, hi / W, [&](int64_t i) {
      const T nv = load<T>(b, i);
      const int8_t s = step_of<T, O>(load<T>(a, i), nv);
      if (k == cnt || (s == kEscape && e == esc)) {
        ok = false;
        return;
      }
      store<uint16_t>(gaps, k, uint16_t(i - begin - prev - 1));
      steps[k++] = s;
      if (s == kEscape) store<T>(escapes, e++, nv);
      prev = i - begin;
    });
  });
  return ok && k == cnt && e == esc;
}

// Pass 2: every chunk's output at its offsets, copied from its slot or re-scanned.
// Returns false if a re-scanned chunk disagreed with pass 1.
template <class T, int O>
bool encode_pass2(const Stream& a, const Stream& b, int64_t n, const uint32_t* table, const int64_t* offsets,
                  const uint8_t* stage, uint8_t* gaps, int8_t* steps, uint8_t* escapes) {
  constexpr int W = sizeof(T);
  const int64_t nc = nchunks(n);
  std::atomic<bool> ok{true};
  parallel_for(nc, 8, [&](int64_t c) {
    const int64_t k0 = offsets[c], e0 = offsets[nc + c], cnt = table[c], esc = table[nc + c];
    if (stage && cnt <= kStage) {
      const uint8_t* slot = stage + c * slot_bytes<T>();
      std::memcpy(gaps + 2 * k0, slot, size_t(2 * cnt));
      std::memcpy(steps + k0, slot + 2 * kStage, size_t(cnt));
      std::memcpy(escapes + W * e0, slot + 3 * kStage, size_t(W * esc));
    } else {
      const int64_t begin = c * kChunk;
      if (!rescan_chunk<T, O>(a, b, begin, begin + chunk_len(n, c), cnt, esc, gaps + 2 * k0, steps + k0,
                              escapes + W * e0))
        ok.store(false);
    }
  });
  return ok.load();
}

// ---- decode and apply ---------------------------------------------------------

// What decoding found wrong in one chunk; bad_change < 0 means positions were fine.
struct ChunkCheck {
  int64_t bad_change = -1;  // global index of the first change outside its chunk
  int64_t bad_offset = 0;   // the offset it landed at
  int64_t chunk = 0;        // the chunk it belongs to
  bool escapes_mismatch = false;
};

// Decode one chunk whose counts were validated against the section sizes,
// handing each (change index, position, new bits) to sink. Each offset is
// checked against the chunk length before old is read there (old_at(pos)
// gives the old bits at a stream position; positions increase), and each
// escape marker against the chunk's escape count before `escapes` is.
template <class T, int O, class Old, class Sink>
ChunkCheck decode_chunk(Old&& old_at, int64_t begin, int64_t len, int64_t k0, int64_t cnt, int64_t e0,
                        int64_t esc, const uint8_t* gaps, const int8_t* steps, const uint8_t* escapes, Sink&& sink) {
  ChunkCheck r;
  int64_t off = -1, e = 0;
  for (int64_t k = k0; k < k0 + cnt; ++k) {
    off += int64_t(load<uint16_t>(gaps, k)) + 1;
    if (off >= len) {
      r.bad_change = k;
      r.bad_offset = off;
      return r;
    }
    const int8_t s = steps[k];
    T v = 0;
    if (s != kEscape) v = apply_step<T, O>(old_at(begin + off), s);
    else if (e < esc) v = load<T>(escapes, e0 + e);
    e += s == kEscape;
    sink(k, begin + off, v);
  }
  r.escapes_mismatch = e != esc;
  return r;
}

// The first failing chunk (lowest index) decides the error, as in the
// reference, which reports the first bad change overall.
inline ChunkCheck first_failure(std::vector<ChunkCheck>& checks) {
  ChunkCheck out;
  for (size_t c = 0; c < checks.size(); ++c) {
    if (checks[c].bad_change >= 0) {  // positions outside a chunk outrank escape mismatches, as in the reference
      checks[c].chunk = int64_t(c);
      return checks[c];
    }
    out.escapes_mismatch = out.escapes_mismatch || checks[c].escapes_mismatch;
  }
  return out;
}

// Decode every chunk in parallel into (positions int64, values T) arrays. If
// old_digests is given, every 1 MiB block of old is hashed too, chunk by chunk
// while it is in cache, so a caller that must verify the base reads it once.
template <class T, int O>
ChunkCheck decode_all(const Stream& old, int64_t n, const uint32_t* table, const int64_t* offsets,
                      const uint8_t* gaps, const int8_t* steps, const uint8_t* escapes, uint8_t* positions,
                      uint8_t* values, uint64_t* old_digests = nullptr) {
  constexpr int W = sizeof(T);
  const Units units(n, W, old_digests != nullptr);
  std::vector<ChunkCheck> checks(static_cast<size_t>(units.nc));
  parallel_for(units.count, 1, [&](int64_t u) {
    BlockHash ho(Units::bytes(n, W, units.first(u), units.last(u)));
    for (int64_t c = units.first(u); c < units.last(u); ++c) {
      const int64_t begin = c * kChunk, len = chunk_len(n, c);
      const int64_t lo = begin * W, hi = (begin + len) * W;
      if (old_digests) hash_range(old, lo, hi, ho);
      with_addresses(old, lo, hi, [&](auto&& oa) {
        checks[c] = decode_chunk<T, O>([&](int64_t pos) { return load<T>(oa(pos * W), 0); }, begin, len, offsets[c],
                                       table[c], offsets[units.nc + c], table[units.nc + c], gaps, steps, escapes,
                                       [&](int64_t k, int64_t pos, T v) {
                                         store<int64_t>(positions, k, pos);
                                         store<T>(values, k, v);
                                       });
      });
    }
    if (old_digests) old_digests[u] = ho.digest();
  });
  return first_failure(checks);
}

// dst[i] = src[i] at every change position of the sections (the publisher's
// mirror taking the new version's changed elements). Each position is checked
// against its chunk's length before anything is written there.
template <class T>
ChunkCheck write_changes(const Stream& dst, const Stream& src, int64_t n, const uint32_t* table,
                         const int64_t* offsets, const uint8_t* gaps) {
  constexpr int W = sizeof(T);
  const int64_t nc = nchunks(n);
  std::vector<ChunkCheck> checks(static_cast<size_t>(nc));
  parallel_for(nc, 8, [&](int64_t c) {
    const int64_t begin = c * kChunk, len = chunk_len(n, c), k0 = offsets[c];
    Cursor dc(dst, begin * W), sc(src, begin * W);
    int64_t off = -1;
    for (int64_t k = k0; k < k0 + int64_t(table[c]); ++k) {
      off += int64_t(load<uint16_t>(gaps, k)) + 1;
      if (off >= len) {
        checks[c].bad_change = k;
        checks[c].bad_offset = off;
        return;
      }
      const int64_t b = (begin + off) * W;
      std::memcpy(dc(b), sc(b), W);
    }
  });
  return first_failure(checks);
}

// Fused out-of-place apply: out = old with the changes written in, plus the
// xxh3 of every 1 MiB block of old and of out, in one pass over old. On a
// failure out holds garbage and must be discarded.
template <class T, int O>
ChunkCheck apply_all(const Stream& old, int64_t n, const uint32_t* table, const int64_t* offsets,
                     const uint8_t* gaps, const int8_t* steps, const uint8_t* escapes, const Stream& out,
                     uint64_t* old_digests, uint64_t* new_digests) {
  constexpr int W = sizeof(T);
  const Units units(n, W, true);
  std::vector<ChunkCheck> checks(static_cast<size_t>(units.nc));
  parallel_for(units.count, 1, [&](int64_t u) {
    const int64_t block = Units::bytes(n, W, units.first(u), units.last(u));
    BlockHash ho(block), hn(block);
    for (int64_t c = units.first(u); c < units.last(u); ++c) {
      const int64_t begin = c * kChunk, len = chunk_len(n, c), lo = begin * W, hi = (begin + len) * W;
      hash_range(old, lo, hi, ho);
      zip_pieces(old, out, lo, hi, [&](uintptr_t po, uintptr_t pd, int64_t l, int64_t r) {
        std::memcpy(at(pd, l), at(po, l), size_t(r - l));
      });
      with_addresses(old, lo, hi, [&](auto&& oa) {
        with_addresses(out, lo, hi, [&](auto&& da) {
          checks[c] = decode_chunk<T, O>([&](int64_t pos) { return load<T>(oa(pos * W), 0); }, begin, len,
                                         offsets[c], table[c], offsets[units.nc + c], table[units.nc + c], gaps,
                                         steps, escapes, [&](int64_t, int64_t pos, T v) { store<T>(da(pos * W), 0, v); });
        });
      });
      hash_range(out, lo, hi, hn);
    }
    old_digests[u] = ho.digest();
    new_digests[u] = hn.digest();
  });
  return first_failure(checks);
}

// Fused in-place apply: bits become the new version, and the xxh3 of every
// 1 MiB block is taken before and after its chunks are written, while they
// are in cache. Each change's position and overwritten bits go to
// positions[k] and saved[k] before the new bits are written, and written[c]
// counts the changes chunk c wrote, so whatever happened (a bad change
// mid-chunk, a later checksum mismatch) restore_written() can put back
// exactly what was overwritten. Positions within a chunk strictly increase
// (gap + 1 >= 1), so no element is written twice and each is read before
// its own write.
template <class T, int O>
ChunkCheck apply_inplace_all(const Stream& bits, int64_t n, const uint32_t* table, const int64_t* offsets,
                             const uint8_t* gaps, const int8_t* steps, const uint8_t* escapes, uint8_t* positions,
                             uint8_t* saved, int64_t* written, uint64_t* old_digests, uint64_t* new_digests) {
  constexpr int W = sizeof(T);
  const Units units(n, W, true);
  std::vector<ChunkCheck> checks(static_cast<size_t>(units.nc));
  parallel_for(units.count, 1, [&](int64_t u) {
    const int64_t block = Units::bytes(n, W, units.first(u), units.last(u));
    BlockHash ho(block), hn(block);
    for (int64_t c = units.first(u); c < units.last(u); ++c) {
      const int64_t begin = c * kChunk, len = chunk_len(n, c), lo = begin * W, hi = (begin + len) * W;
      hash_range(bits, lo, hi, ho);
      int64_t w = 0;
      with_addresses(bits, lo, hi, [&](auto&& ba) {
        checks[c] = decode_chunk<T, O>([&](int64_t pos) { return load<T>(ba(pos * W), 0); }, begin, len, offsets[c],
                                       table[c], offsets[units.nc + c], table[units.nc + c], gaps, steps, escapes,
                                       [&](int64_t k, int64_t pos, T v) {
                                         uint8_t* p = ba(pos * W);
                                         store<int64_t>(positions, k, pos);
                                         store<T>(saved, k, load<T>(p, 0));
                                         store<T>(p, 0, v);
                                         ++w;
                                       });
      });
      written[c] = w;
      hash_range(bits, lo, hi, hn);
    }
    old_digests[u] = ho.digest();
    new_digests[u] = hn.digest();
  });
  return first_failure(checks);
}

// Undo apply_inplace_all: the first written[c] changes of every chunk get their saved bits back.
template <class T>
void restore_written(const Stream& bits, int64_t nc, const int64_t* offsets, const int64_t* written,
                     const uint8_t* positions, const uint8_t* saved) {
  constexpr int W = sizeof(T);
  parallel_for(nc, 8, [&](int64_t c) {
    Cursor bc(bits, c * kChunk * W);
    for (int64_t k = offsets[c]; k < offsets[c] + written[c]; ++k)
      store<T>(bc(load<int64_t>(positions, k) * W), 0, load<T>(saved, k));
  });
}

// bits[positions[k]] = values[k] for k in [0, count), positions in any order
// (checked by the caller to lie in the stream), in order: a repeated position
// keeps its last value.
template <class T>
void put_values(const Stream& bits, const uint8_t* positions, const uint8_t* values, int64_t count) {
  constexpr int W = sizeof(T);
  Finder f(bits);
  for (int64_t k = 0; k < count; ++k) store<T>(f(load<int64_t>(positions, k) * W), 0, load<T>(values, k));
}

// Exclusive prefix sums of the table's two halves: where each chunk's changes
// and escapes start. Returns the totals via the last two arguments.
inline void table_offsets(const uint32_t* table, int64_t nc, int64_t* offsets, int64_t* total, int64_t* total_esc) {
  int64_t k = 0, e = 0;
  for (int64_t c = 0; c < nc; ++c) {
    offsets[c] = k;
    offsets[nc + c] = e;
    k += table[c];
    e += table[nc + c];
  }
  *total = k;
  *total_esc = e;
}

// Call f(T{}, std::integral_constant<int, O>{}) for a runtime width and order,
// so each (width, order) pair gets its own fully inlined loop.
template <class F>
inline bool dispatch(int width, int order, F&& f) {
  auto by_order = [&](auto zero) {
    switch (order) {
      case kFloat: f(zero, std::integral_constant<int, kFloat>{}); return true;
      case kInt: f(zero, std::integral_constant<int, kInt>{}); return true;
      case kUint: f(zero, std::integral_constant<int, kUint>{}); return true;
    }
    return false;
  };
  switch (width) {
    case 1: return by_order(uint8_t{});
    case 2: return by_order(uint16_t{});
    case 4: return by_order(uint32_t{});
    case 8: return by_order(uint64_t{});
  }
  return false;
}

}  // namespace wsync
