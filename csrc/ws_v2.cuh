// Delta codec v2 (wsync/codecs/v2_ref.py is the spec): the decoder of one chunk, written once for the
// C++ backend (csrc/ws_v2.h drives it over chunks on the thread pool) and for a CUDA kernel that runs one
// chunk per thread. No STL, no allocation: the caller hands in the model and the scratch.
#pragma once

#include "ws_common.cuh"

namespace ws {
namespace v2 {

constexpr int NCLASS = 256;
constexpr int NSYM = 15;
constexpr int ESC = 14;
constexpr int SMALL = 7;
constexpr int PROB_BITS = 12;
constexpr u32 PROB_SCALE = 1u << PROB_BITS;
constexpr u32 RANS_L = 1u << 23;

// Errors of a chunk's decode; ws_v2.h turns them into messages.
enum Err {
  OK = 0,
  BITS_SHORT,      // the position bitstream ends early
  BITS_LEFT,       // bits left over after the last code
  TOO_MANY,        // more changes than the model declares
  STEPS_NO_CHANGE, // steps for a chunk without changes
  RANS_SHORT,      // rANS stream too short / ends early
  RANS_STATE,      // initial state out of range
  RANS_END,        // does not end where it should
  ESC_LONG,        // escape longer than the element
  ESC_RANGE,       // escape step does not fit the element
};

// The decoder's view of the model: per class its Golomb parameter (0: no changes), frequencies,
// cumulative frequencies and the slot -> symbol table of rANS.
struct Model {
  u64 m[NCLASS];
  u32 freq[NCLASS][NSYM];
  u32 cum[NCLASS][NSYM];
  u8 slot[NCLASS][PROB_SCALE];
};

// The same, as flat arrays (what a kernel gets): freq/cum [NCLASS * NSYM], slot [NCLASS * PROB_SCALE].
struct ModelView {
  const u64* m;
  const u32* freq;
  const u32* cum;
  const u8* slot;
};

// v2_ref.value_class. kind: 0 float (shift = mantissa bits, ebits = exponent bits), 1 int, 2 uint.
template <class T>
WS_HD u32 value_class(T x, int kind, int shift, int ebits) {
  if (kind == 0) {
    u64 e = (u64(x) >> shift) & ((u64(1) << ebits) - 1);
    if (ebits > 8) e >>= (ebits - 8);
    return u32(e);
  }
  u64 v = u64(x);
  if (kind == 1 && (x & sign_bit<T>())) v = u64(T(~x));
  u32 n = 0;
  while (v) {
    ++n;
    v >>= 1;
  }
  return n;
}

// The classes of old[0..len) into out: one loop per kind, so the float one is a plain shift-and-mask.
template <class T>
WS_HD void classes(const T* old, u32 len, int kind, int shift, int ebits, u8* out) {
  if (kind == 0) {
    const u64 mask = (u64(1) << ebits) - 1;
    const int drop = shift + (ebits > 8 ? ebits - 8 : 0);
    const u64 m2 = ebits > 8 ? 0xFF : mask;
    for (u32 o = 0; o < len; ++o) out[o] = u8((u64(old[o]) >> drop) & m2);
  } else {
    for (u32 o = 0; o < len; ++o) out[o] = u8(value_class<T>(old[o], kind, shift, ebits));
  }
}

struct BitReader {
  const u8* data;
  u64 nbits;
  u64 pos;
  WS_HD bool get(int n, u64* out) {  // n <= 32
    if (pos + u64(n) > nbits) return false;
    u64 v = 0;
    for (int i = 0; i < n;) {
      const u64 p = pos + u64(i);
      const int take = (8 - int(p & 7)) < (n - i) ? (8 - int(p & 7)) : (n - i);
      v |= (u64(data[p >> 3] >> (p & 7)) & ((1u << take) - 1)) << i;
      i += take;
    }
    pos += u64(n);
    *out = v;
    return true;
  }
  WS_HD bool bit(u64* out) { return get(1, out); }
};

// v2_ref.get_gap: the next gap (< r) in *g, or *end = true for the end mark. False: the stream ended early.
WS_HD bool get_gap(BitReader& rd, u64 m, u64 r, u64* g, bool* end) {
  u64 q = 0;
  while (q * m < r) {
    u64 b;
    if (!rd.bit(&b)) return false;
    if (!b) {
      u64 s = r - q * m;
      if (m < s) s = m;
      u64 v = 0;
      if (s > 1) {
        int k = 0;  // floor(log2 s); s <= 65536 in any chunk
        while ((s >> (k + 1)) != 0) ++k;
        const u64 u = (u64(2) << k) - s;
        if (!rd.get(k, &v)) return false;
        if (v >= u) {
          u64 lo;
          if (!rd.bit(&lo)) return false;
          v = ((v << 1) | lo) - u;
        }
      }
      *g = q * m + v;
      *end = false;
      return true;
    }
    ++q;
  }
  *end = true;
  return true;
}

// v2_ref.get_escape: a signed step of a width_bits-bit element, as i64.
WS_HD int get_escape(BitReader& rd, int width_bits, i64* d) {
  u64 neg, b;
  if (!rd.bit(&neg)) return BITS_SHORT;
  int n = 0;
  for (;;) {
    if (!rd.bit(&b)) return BITS_SHORT;
    if (b) break;
    if (++n >= width_bits) return ESC_LONG;
  }
  u64 lo = 0, hi = 0;
  if (n > 32) {
    if (!rd.get(32, &lo) || !rd.get(n - 32, &hi)) return BITS_SHORT;
    lo |= hi << 32;
  } else if (!rd.get(n, &lo)) {
    return BITS_SHORT;
  }
  const u64 mag = ((u64(1) << n) | lo) + SMALL;
  const u64 lim = u64(1) << (width_bits - 1);
  if (mag < u64(1) << n || mag > lim || (mag == lim && !neg)) return ESC_RANGE;
  *d = neg ? i64(u64(0) - mag) : i64(mag);
  return OK;
}

// Scratch of one chunk: arrays of cap entries (cap >= the chunk's length) and tables of NCLASS.
struct Scratch {
  u32* rank;   // [cap] rank within its class, coding order
  u8* cls;     // [cap] class, coding order
  i64* d;      // [cap] step, coding order
  u32* first;  // [NCLASS + 1] coding index of the class's first change
  u32* h;      // [WALKERS * NCLASS] class counts per quarter of the chunk, then countdowns while placing
  u32* nxt;    // [WALKERS * NCLASS] coding index of the class's next change each walker places
  u8* of;      // [cap] class of each element of the chunk
};

// The chunk is cut in WALKERS quarters walked side by side: each class count is a chain of increments
// through memory, and four independent chains keep the core busy while one waits on the last.
constexpr int WALKERS = 4;  // the walks in decode_chunk are unrolled for four

template <class T>
WS_HD void quarter_bounds(u32 len, u32* b) {
  const u32 q = (len + WALKERS - 1) / WALKERS;
  for (int w = 0; w <= WALKERS; ++w) b[w] = u32(w) * q < len ? u32(w) * q : len;
}

// Decode one chunk of len elements against old[0..len). On success writes *count changes in position
// order: off[i] (offset in chunk) and step[i]. budget: changes the chunk may hold at most.
template <class T>
WS_HD int decode_chunk(const T* old, u32 len, const u8* pb, u64 plen, const u8* sb, u64 slen, ModelView md,
                       int lo, int hi, int kind, int shift, int ebits, u64 budget, Scratch sc, u32* off, i64* step,
                       u32* count) {
  const int width_bits = int(8 * sizeof(T));
  u32 b[WALKERS + 1];
  quarter_bounds<T>(len, b);
  // Quarters never grow with w ([q, .., q, r, 0, ..] for a short chunk): the last is the shortest, and all
  // walk side by side through it; then each longer quarter finishes alone.
  const u32 common = b[WALKERS] - b[WALKERS - 1];
  classes<T>(old, len, kind, shift, ebits, sc.of);
  for (int i = 0; i < WALKERS * NCLASS; ++i) sc.h[i] = 0;
  {
    const u8* c0 = sc.of + b[0];
    const u8* c1 = sc.of + b[1];
    const u8* c2 = sc.of + b[2];
    const u8* c3 = sc.of + b[3];
    u32* h = sc.h;
    for (u32 i = 0; i < common; ++i) {
      h[c0[i]]++;
      h[NCLASS + c1[i]]++;
      h[2 * NCLASS + c2[i]]++;
      h[3 * NCLASS + c3[i]]++;
    }
    for (int w = 0; w + 1 < WALKERS; ++w)
      for (u32 o = b[w] + common; o < b[w + 1]; ++o) h[w * NCLASS + sc.of[o]]++;
  }
  BitReader rd{pb, 8 * plen, 0};
  u32 k = 0;
  for (int c = 0; c <= NCLASS; ++c) sc.first[c] = 0;
  for (int c = lo; c < hi; ++c) {
    sc.first[c] = k;
    const u64 m = md.m[c];
    u64 pop = 0;
    for (int w = 0; w < WALKERS; ++w) pop += sc.h[w * NCLASS + c];
    if (!m || !pop) continue;
    u64 nxt = 0;
    for (;;) {
      u64 g;
      bool end;
      if (!get_gap(rd, m, pop - nxt, &g, &end)) return BITS_SHORT;
      if (end) break;
      if (u64(k) >= budget) return TOO_MANY;
      sc.rank[k] = u32(nxt + g);
      sc.cls[k] = u8(c);
      ++k;
      nxt += g + 1;
    }
  }
  for (int c = hi; c <= NCLASS; ++c) sc.first[c] = k;
  if (k == 0) {
    if (slen) return STEPS_NO_CHANGE;
  } else {
    if (slen < 4) return RANS_SHORT;
    u32 x = u32(sb[0]) | (u32(sb[1]) << 8) | (u32(sb[2]) << 16) | (u32(sb[3]) << 24);
    if (x < RANS_L || x >= (RANS_L << 8)) return RANS_STATE;
    u64 at = 4;
    for (u32 i = 0; i < k; ++i) {
      const int c = sc.cls[i];
      const u32 slot = x & (PROB_SCALE - 1);
      const int s = md.slot[c * PROB_SCALE + int(slot)];
      x = md.freq[c * NSYM + s] * (x >> PROB_BITS) + slot - md.cum[c * NSYM + s];
      while (x < RANS_L) {
        if (at >= slen) return RANS_SHORT;
        x = (x << 8) | sb[at++];
      }
      sc.d[i] = s < SMALL ? i64(s - SMALL) : s < ESC ? i64(s - SMALL + 1) : 0;
    }
    if (x != RANS_L || at != slen) return RANS_END;
    for (u32 i = 0; i < k; ++i)
      if (sc.d[i] == 0) {
        const int e = get_escape(rd, width_bits, &sc.d[i]);
        if (e) return e;
      }
  }
  const u64 left = rd.nbits - rd.pos;
  if (left >= 8) return BITS_LEFT;
  if (left) {
    u64 pad;
    rd.get(int(left), &pad);
    if (pad) return BITS_LEFT;
  }
  // Place the changes. A class's change of rank r sits where that class's count reaches r. Walker w starts
  // at the classes' counts in the quarters before its own and places the ranks that fall in its quarter,
  // into its own stretch of the output: in position order. h becomes a countdown per (walker, class): the
  // elements of that class to pass before the next change to place (~0u: none left; it never reaches 0).
  u32 out_at[WALKERS];
  u32 placed = 0;
  for (int c = 0; c < NCLASS; ++c) {
    u32 before = 0, j = sc.first[c];
    const u32 end = sc.first[c + 1];
    for (int w = 0; w < WALKERS; ++w) {
      const u32 here = sc.h[w * NCLASS + c];
      while (j < end && sc.rank[j] < before) ++j;
      sc.nxt[w * NCLASS + c] = j;
      sc.h[w * NCLASS + c] = j < end ? sc.rank[j] - before : ~0u;  // rank[j] >= before
      before += here;
    }
  }
  for (int w = 0; w < WALKERS; ++w) {
    out_at[w] = placed;
    for (int c = 0; c < NCLASS; ++c) {
      const u32 stop = w + 1 < WALKERS ? sc.nxt[(w + 1) * NCLASS + c] : sc.first[c + 1];
      placed += stop - sc.nxt[w * NCLASS + c];
    }
  }
  u32* h = sc.h;
  const u8* of = sc.of;
  // one walker's step at element o; the branch is taken once per change, so it predicts well. Ranks of a
  // class strictly increase, so the next countdown is the gap between them.
#define WS_V2_WALK(w, o)                                                                      \
  {                                                                                           \
    const int at = (w) * NCLASS + int(of[o]);                                                 \
    if (h[at]-- == 0) {                                                                       \
      const u32 j = sc.nxt[at]++;                                                             \
      off[out_at[w]] = (o);                                                                   \
      step[out_at[w]] = sc.d[j];                                                              \
      ++out_at[w];                                                                            \
      h[at] = j + 1 < sc.first[int(of[o]) + 1] ? sc.rank[j + 1] - sc.rank[j] - 1 : ~0u;     \
    }                                                                                         \
  }
  for (u32 i = 0; i < common; ++i) {
    WS_V2_WALK(0, b[0] + i)
    WS_V2_WALK(1, b[1] + i)
    WS_V2_WALK(2, b[2] + i)
    WS_V2_WALK(3, b[3] + i)
  }
  for (int w = 0; w + 1 < WALKERS; ++w)
    for (u32 o = b[w] + common; o < b[w + 1]; ++o) WS_V2_WALK(w, o)
#undef WS_V2_WALK
  *count = k;
  return OK;
}

}  // namespace v2
}  // namespace ws
