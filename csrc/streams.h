// Streams: one virtual 1-D array of bytes made of pieces back to back.
//
// A multi-tensor segment (wsync/tables.py) is many tensors of one dtype that
// the kernels treat as their concatenation: element positions, chunks and the
// 1 MiB checksum blocks are all those of the concatenated bytes, and chunks
// and blocks run across piece boundaries. A plain buffer is a stream of one
// piece, so every kernel has a single code path.
//
// Piece i holds stream bytes [starts[i], starts[i+1]) at address addrs[i].
// Pieces may be empty. The helpers below hand kernels a piece's "base": the
// address of stream byte 0 as if the piece extended that far back, so global
// byte (or element) offsets index it directly. Bases are computed in
// uintptr_t and only ever dereferenced inside their piece.
#pragma once

#include <algorithm>
#include <cstdint>

namespace wsync {

struct Stream {
  const int64_t* addrs = nullptr;
  const int64_t* starts = nullptr;  // n + 1 entries: starts[0] == 0, non-decreasing, starts[n] == total bytes
  int64_t n = 0;                    // pieces

  int64_t bytes() const { return n ? starts[n] : 0; }

  // The piece holding stream byte b (starts[i] <= b < starts[i+1]; empty pieces
  // are skipped), or n if b is at or past the end.
  int64_t find(int64_t b) const {
    if (n == 1) return b < starts[1] ? 0 : 1;
    const int64_t i = int64_t(std::upper_bound(starts, starts + n + 1, b) - starts) - 1;
    return std::min(i, n);
  }

  uintptr_t base(int64_t i) const { return uintptr_t(addrs[i]) - uintptr_t(starts[i]); }
};

template <class P = uint8_t>
inline P* at(uintptr_t base, int64_t byte) {
  return reinterpret_cast<P*>(base + uintptr_t(byte));
}

// f(base, lo, hi) for each non-empty run [lo, hi) of [b0, b1) inside one piece, in order.
template <class F>
inline void for_pieces(const Stream& s, int64_t b0, int64_t b1, F&& f) {
  if (b0 >= b1) return;
  for (int64_t i = s.find(b0), lo = b0; lo < b1; ++i) {
    const int64_t hi = std::min(b1, s.starts[i + 1]);
    if (hi > lo) {
      f(s.base(i), lo, hi);
      lo = hi;
    }
  }
}

// f(base_a, base_b, lo, hi) for each run [lo, hi) of [b0, b1) that lies in one
// piece of a and one piece of b (the two may be cut in different places).
template <class F>
inline void zip_pieces(const Stream& a, const Stream& b, int64_t b0, int64_t b1, F&& f) {
  if (b0 >= b1) return;
  int64_t i = a.find(b0), j = b.find(b0), lo = b0;
  while (lo < b1) {
    while (a.starts[i + 1] <= lo) ++i;  // skips empty pieces; never passes the end while lo < b1 <= total
    while (b.starts[j + 1] <= lo) ++j;
    const int64_t hi = std::min({b1, a.starts[i + 1], b.starts[j + 1]});
    f(a.base(i), b.base(j), lo, hi);
    lo = hi;
  }
}

// Addresses of increasing stream bytes, walking forward from where it starts:
// for the decode and apply sinks, whose positions increase within a chunk.
struct Cursor {
  const Stream* s;
  int64_t i, end;
  uintptr_t b;
  Cursor(const Stream& st, int64_t byte) : s(&st), i(st.find(byte)) { load(); }
  void load() {
    if (i < s->n) {
      end = s->starts[i + 1];
      b = s->base(i);
    } else {
      end = INT64_MAX;  // past the end: callers check positions before asking
      b = 0;
    }
  }
  // Address of stream byte `byte` (>= every byte asked before, < the stream's end).
  uint8_t* operator()(int64_t byte) {
    if (byte >= end) {
      do ++i;
      while (i < s->n && s->starts[i + 1] <= byte);
      load();
    }
    return at(b, byte);
  }
};

// Addresses in a range that lies in one piece: no bounds to track.
struct Flat {
  uintptr_t b;
  uint8_t* operator()(int64_t byte) const { return at(b, byte); }
};

// f(addr) with addr(byte) -> address, for increasing bytes in [lo, hi): a
// Flat when the range lies in one piece (always, for a plain buffer), else a
// Cursor. The kernels are instantiated for both, so the one-piece case runs
// the same code as before streams existed.
template <class F>
inline void with_addresses(const Stream& s, int64_t lo, int64_t hi, F&& f) {
  const int64_t i = s.find(lo);
  if (i < s.n && s.starts[i + 1] >= hi) {
    f(Flat{s.base(i)});
  } else {
    Cursor c(s, lo);
    f(c);
  }
}

// Address of stream byte `byte` in any order: a cached piece, else a binary search.
struct Finder {
  const Stream* s;
  int64_t i = -1, lo = 0, hi = 0;
  uintptr_t b = 0;
  explicit Finder(const Stream& st) : s(&st) {}
  uint8_t* operator()(int64_t byte) {
    if (byte < lo || byte >= hi) {
      i = s->find(byte);
      lo = s->starts[i];
      hi = s->starts[i + 1];
      b = s->base(i);
    }
    return at(b, byte);
  }
};

}  // namespace wsync
