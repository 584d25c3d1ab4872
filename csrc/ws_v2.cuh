// Delta codec v2 (wsync/codecs/v2_ref.py is the spec): the decoder of one chunk for the C++ backend
// (csrc/ws_v2.h drives it over chunks on the thread pool), and the reading of a chunk's codes
// (decode_codes) that it shares with the CUDA kernel, a warp per chunk (csrc/ws_v2_cuda.cu), which counts
// and places over its lanes instead. No STL, no allocation: the caller hands in the model and the scratch.
#pragma once

#include "ws_common.cuh"

// The host build selects with SSE2 (every x86-64 CPU); the GPU, NVRTC and the CPU harness (which defines
// __CUDA_ARCH__) take the portable code beside it. Both find the same elements.
#if !defined(__CUDA_ARCH__) && defined(__SSE2__)
#include <emmintrin.h>
#define WS_V2_SSE2 1
#else
#define WS_V2_SSE2 0
#endif
// The per-change helpers of decode_chunk, inlined into it on the host too (g++ left select_in a call in
// the extension's build, and one call per change showed in profiles).
#if defined(__CUDACC__) || !defined(__GNUC__)
#define WS_V2_INLINE WS_HD
#else
#define WS_V2_INLINE __attribute__((always_inline)) inline
#endif

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
  PLACE,           // a rank with no element to place it at (never: ranks stay under the class's count)
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
    const T tm = T(m2);
    u32 o = 0;
#if WS_V2_SSE2
    // Sixteen at a time in T's own lanes: the compiler's vectorisation of the loop below widens 16-bit
    // lanes to 32 for C's int promotion, and takes three times as long.
    if (sizeof(T) == 2 || sizeof(T) == 4) {
      const __m128i count = _mm_cvtsi32_si128(drop);
      const __m128i keep = sizeof(T) == 2 ? _mm_set1_epi16(short(m2)) : _mm_set1_epi32(int(m2));
      for (; o + 16 <= len; o += 16) {
        const __m128i* p = reinterpret_cast<const __m128i*>(old + o);
        __m128i lo, hi;
        if (sizeof(T) == 2) {
          lo = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(p), count), keep);
          hi = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(p + 1), count), keep);
        } else {  // four lanes of 32 bits per register: to 16 bits first (values < 256, so the pack is exact)
          lo = _mm_packs_epi32(_mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(p), count), keep),
                               _mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(p + 1), count), keep));
          hi = _mm_packs_epi32(_mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(p + 2), count), keep),
                               _mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(p + 3), count), keep));
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + o), _mm_packus_epi16(lo, hi));
      }
    }
#endif
    for (; o < len; ++o) out[o] = u8(T(old[o] >> drop) & tm);
  } else {
    for (u32 o = 0; o < len; ++o) out[o] = u8(value_class<T>(old[o], kind, shift, ebits));
  }
}

// Bit scans (x != 0): the GPU's intrinsics, or the compiler's builtins (g++ and the CPU harness's own).
WS_HD int ctz64(u64 x) {
#if defined(__CUDA_ARCH__)
  return __ffsll((long long)x) - 1;
#else
  return __builtin_ctzll(x);
#endif
}
WS_HD int log2_64(u64 x) {
#if defined(__CUDA_ARCH__)
  return 63 - __clzll((long long)x);
#else
  return 63 - __builtin_clzll(x);
#endif
}

// The position bitstream, least significant bit of each byte first. Reads go through a 64-bit window at
// pos (peek), so a code of up to 57 bits costs one load, not a loop over its bits.
constexpr int WINDOW = 57;

struct BitReader {
  const u8* data;
  u64 nbits;  // 8 * bytes
  u64 pos;
  WS_HD u64 left() const { return nbits - pos; }
  // The next min(57, left()) bits in the low bits (the rest zero past the end of the stream).
  WS_HD u64 peek() const {
    const u64 at = pos >> 3, nbytes = nbits >> 3;
    u64 w = 0;
#if !defined(__CUDA_ARCH__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (at + 8 <= nbytes) {
      __builtin_memcpy(&w, data + at, 8);
      return w >> (pos & 7);
    }
#endif
    const u64 end = at + 8 < nbytes ? at + 8 : nbytes;
    for (u64 i = at; i < end; ++i) w |= u64(data[i]) << (8 * (i - at));
    return w >> (pos & 7);
  }
  WS_HD bool get(int n, u64* out) {  // n <= 57
    if (u64(n) > left()) return false;
    *out = n ? peek() & ((u64(1) << n) - 1) : 0;
    pos += u64(n);
    return true;
  }
  WS_HD bool bit(u64* out) { return get(1, out); }
};

// v2_ref.get_gap: the next gap (< r) in *g, or *end = true for the end mark. False: the stream ended early.
// The quotient is a run of ones (one per m) ended by a zero, or cut short by the end mark once q * m >= r
// (then no zero follows): each window's run is counted with one bit scan.
WS_HD bool get_gap(BitReader& rd, u64 m, u64 r, u64* g, bool* end) {
  u64 q = 0;
  for (;;) {
    if (q * m >= r) {  // m <= 2^32 and r <= 2^16 (read_model, the chunk): no overflow
      *end = true;
      return true;
    }
    const u64 avail = rd.left() < u64(WINDOW) ? rd.left() : u64(WINDOW);
    if (!avail) return false;
    const u64 zeros = ~rd.peek() & ((u64(1) << avail) - 1);
    const u64 ones = zeros ? u64(ctz64(zeros)) : avail;
    if ((q + ones) * m >= r) {  // the end mark within this run: ceil(r / m) ones in all
      rd.pos += (r + m - 1) / m - q;
      *end = true;
      return true;
    }
    q += ones;
    rd.pos += ones;
    if (zeros) {
      ++rd.pos;  // the zero that ends the quotient
      break;
    }
  }
  u64 s = r - q * m;
  if (m < s) s = m;
  u64 v = 0;
  if (s > 1) {
    const int k = log2_64(s);  // s <= 2^32
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

// get_gap's common case from one window: a quotient run ended by its zero, short of the end mark, and a
// remainder of the full truncated-binary width (s == m: k = log2(m), u = 2^(k+1) - m, the class's own),
// its longer form taken without a branch. False, nothing read, for anything else (the stream's last 57
// bits, a run past the window, the last codes of a class): get_gap reads those the long way.
WS_V2_INLINE bool gap_fast(BitReader& rd, u64 m, int k, u64 u, u64 r, u64* g) {
  if (rd.left() < u64(WINDOW)) return false;
  const u64 w = rd.peek();
  const u64 zeros = ~w & ((u64(1) << WINDOW) - 1);
  if (!zeros) return false;
  const u64 q = u64(ctz64(zeros));
  if ((q + 1) * m > r) return false;  // near the end mark, or a remainder narrower than m
  const u64 at = q + 1;
  if (at + u64(k) + 1 > u64(WINDOW)) return false;
  u64 v = (w >> at) & ((u64(1) << k) - 1);
  const u64 more = v >= u;
  v = more ? ((v << 1) | ((w >> (at + u64(k))) & 1)) - u : v;
  rd.pos += at + u64(k) + more;
  *g = q * m + v;
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

// Placement of a class's changes works over blocks of BLOCK elements: the counting pass keeps, per block,
// each coded class's count before it (snap), so a change of rank r is found by moving to the block where
// the count passes r and selecting inside it, with no second walk over every element.
constexpr u32 BLOCK = 128;
constexpr u32 NBLOCK = CHUNK / BLOCK;
// A class's row of block counts. Padded past NBLOCK so that the rows the counting pass writes side by side
// (rows 2 KiB apart) do not all fall in the same few sets of a CPU's L1 cache.
constexpr u32 SNAP_ROW = NBLOCK + 16;
static_assert(SNAP_ROW > NBLOCK, "a row holds a count before each block");

// Scratch of one chunk: arrays of cap entries (cap >= the chunk's length) and tables of NCLASS.
struct Scratch {
  u32* rank;   // [cap] rank within its class, coding order
  i64* d;      // [cap] step, coding order
  u32* first;  // [NCLASS + 1] coding index of the class's first change
  u32* h;      // [WALKERS * NCLASS] class counts per quarter of the chunk
  u32* qb;     // [WALKERS * NCLASS] class counts in the quarters before each quarter
  u8* of;      // [cap rounded up to BLOCK] class of each element of the chunk (read by whole blocks)
  u32* snap;   // [NCLASS * SNAP_ROW] per class in [lo, hi) (a row each), its count before each block
  u64* mark;   // [CHUNK / 64] one bit per element: a change sits there
  u16* at;     // [cap] coding index of the change at each marked element
};

// The chunk is cut in WALKERS quarters counted side by side: each class count is a chain of increments
// through memory, and four independent chains keep the core busy while one waits on the last.
constexpr int WALKERS = 4;  // the counting loop in decode_chunk is unrolled for four

// Eight classes of of[o..o+8) (o a multiple of 8; the array is aligned and long enough).
WS_HD u64 load8(const u8* p) {
#if defined(__CUDACC__)
  return *reinterpret_cast<const u64*>(p);
#else
  u64 w;
  __builtin_memcpy(&w, p, 8);
  return w;
#endif
}

#if WS_V2_SSE2
// One bit per element of of[o..o+64) equal to c (rep: c in every byte).
inline u64 match64(const u8* of, u32 o, __m128i rep) {
  u64 m = 0;
  for (int v = 0; v < 4; ++v)
    m |= u64(u32(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(of + o + 16 * v)), rep))))
         << (16 * v);
  return m;
}

// x's set bits counted per byte, the bytes' running sums in one multiply: byte i holds the set bits of
// bytes 0..i, so the top byte is the count (plain x86-64 has no popcnt instruction).
inline u64 byte_sums(u64 x) {
  u64 s = x - ((x >> 1) & 0x5555555555555555ull);
  s = (s & 0x3333333333333333ull) + ((s >> 2) & 0x3333333333333333ull);
  s = (s + (s >> 4)) & 0x0F0F0F0F0F0F0F0Full;
  return s * 0x0101010101010101ull;
}

// kSel8.at[b][r]: the position of the r-th (from 0) set bit of the byte b.
struct Sel8 {
  u8 at[256][8];
  constexpr Sel8() : at() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0, r = 0; i < 8; ++i)
        if (b >> i & 1) at[b][r++] = u8(i);
  }
};
constexpr Sel8 kSel8{};

// The position of x's k-th (from 0) set bit, or 64 when x has k or fewer: the byte that holds it found from
// the running sums (the bytes whose sum is <= k, counted by one multiply; no borrows cross bytes), then a
// table lookup inside the byte. No branch on the data but the one that refuses a k past the count.
inline u32 select64(u64 x, u32 k) {
  const u64 ones = 0x0101010101010101ull, high = 0x8080808080808080ull;
  const u64 run = byte_sums(x);
  if (k >= u32(run >> 56)) return 64;
  const u32 byte = u32((((((u64(k) * ones) | high) - run) & high) >> 7) * ones >> 56);
  const u32 before = u32(((run << 8) >> (8 * byte)) & 0xFF);
  return 8 * byte + kSel8.at[(x >> (8 * byte)) & 0xFF][k - before];
}
#endif

// The o in [from, to) of the need-th (from 0) element of class c, to if there is none. [from, to) is one
// block (from a multiple of BLOCK; of is readable to the block's end). On the host the block's two 64-bit
// match masks (SSE2 byte compares) and a select in the one that holds it, without branches on the data;
// on the GPU eight classes at a time, each byte equal to c flagged exactly (its high bit), the flags
// counted with one multiply.
WS_V2_INLINE u32 select_in(const u8* of, u32 from, u32 to, u32 c, u32 need) {
#if WS_V2_SSE2
  static_assert(BLOCK == 128, "select_in reads a block as two 64-bit masks");
  const __m128i rep = _mm_set1_epi8(char(c));
  const u32 n = to - from;  // 1 .. BLOCK
  const u64 m0 = match64(of, from, rep) & (n >= 64 ? ~u64(0) : (u64(1) << n) - 1);
  const u64 m1 = n <= 64 ? 0 : match64(of, from + 64, rep) & (n == 128 ? ~u64(0) : (u64(1) << (n - 64)) - 1);
  const u32 c0 = u32(byte_sums(m0) >> 56);
  const bool second = need >= c0;
  const u32 at = select64(second ? m1 : m0, second ? need - c0 : need);
  return at < 64 ? from + (second ? 64 : 0) + at : to;
#else
  const u64 ones = 0x0101010101010101ull, low7 = 0x7F7F7F7F7F7F7F7Full;
  const u64 rep = ones * u64(c);
  for (u32 o = from; o < to; o += 8) {
    const u64 x = load8(of + o) ^ rep;
    u64 t = ~(((x & low7) + low7) | x | low7);
    if (to - o < 8) t &= (u64(1) << (8 * (to - o))) - 1;
    const u32 cnt = u32(((t >> 7) * ones) >> 56);
    if (need < cnt) {
      for (; need; --need) t &= t - 1;
      return o + u32(ctz64(t)) / 8;
    }
    need -= cnt;
  }
  return to;
#endif
}

// The block (from g on) that holds a class's change of rank r: the last b < nb whose count before it,
// row[b], is <= r (row[0] is 0; rows never decrease). Ranks come in order, so g only moves forward; on
// the host sixteen, then four blocks are compared at a time.
WS_V2_INLINE u32 block_of(const u32* row, u32 g, u32 nb, u32 r) {
#if WS_V2_SSE2
  const __m128i rv = _mm_set1_epi32(int(r));  // counts and ranks are < 2^16: signed compares are exact
  // Sixteen blocks a step first: a class's next change is most often a few blocks on, so one step holds
  // it, and the branch that leaves is one the core predicts.
  while (g + 16 < nb) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + g + 1);
    const auto past = [&](int i) { return _mm_cmpgt_epi32(_mm_loadu_si128(p + i), rv); };  // 4 blocks' flags
    const int m = _mm_movemask_epi8(
        _mm_packs_epi16(_mm_packs_epi32(past(0), past(1)), _mm_packs_epi32(past(2), past(3))));
    if (m) return g + u32(__builtin_ctz(unsigned(m)));
    g += 16;
  }
  while (g + 4 < nb) {
    const int m = _mm_movemask_ps(_mm_castsi128_ps(
        _mm_cmpgt_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g + 1)), rv)));
    if (!m) {
      g += 4;
      continue;
    }
    return g + u32(__builtin_ctz(unsigned(m)));
  }
#endif
  while (g + 1 < nb && row[g + 1] <= r) ++g;
  return g;
}

// The class counts decode_chunk's walkers leave: a class's count in the chunk is the sum of its quarters'.
struct QuarterPop {
  const u32* h;
  WS_HD u64 operator()(int c) const {
    u64 p = 0;
    for (int w = 0; w < WALKERS; ++w) p += h[w * NCLASS + c];
    return p;
  }
};

// A chunk's codes in v2_ref's order: per coded class in [lo, hi) its gaps (ranks within the class) with
// each change's rANS step taken as soon as its gap is read, then the escapes, then the padding. pop(c): the
// class's element count in the chunk. Writes rank[j] and d[j] in coding order and first[c], the coding
// index of class c's first change (first[hi..NCLASS] = the count), and *count. Shared by decode_chunk (the
// C++ backend) and the GPU's warp per chunk (csrc/ws_v2_cuda.cu); budget: changes the chunk may hold.
template <class Pop>
WS_V2_INLINE int decode_codes(const u8* pb, u64 plen, const u8* sb, u64 slen, ModelView md, int lo, int hi,
                              int width_bits, u64 budget, const Pop& pop, u32* rank, i64* d, u32* first,
                              u32* count) {
  BitReader rd{pb, 8 * plen, 0};
  u32 k = 0;
  // Each change's rANS step is taken as soon as its gap is read: the two streams are independent chains,
  // and side by side the core runs them at once. A rANS error waits until every gap is read, so errors
  // come out in the order of decoding the gaps first (v2_ref).
  int rerr = slen < 4 ? RANS_SHORT : OK;
  u32 x = 0;
  u64 at = 4;
  if (!rerr) {
    x = u32(sb[0]) | (u32(sb[1]) << 8) | (u32(sb[2]) << 16) | (u32(sb[3]) << 24);
    if (x < RANS_L || x >= (RANS_L << 8)) rerr = RANS_STATE;
  }
  for (int c = 0; c <= NCLASS; ++c) first[c] = 0;
  for (int c = lo; c < hi; ++c) {
    first[c] = k;
    const u64 m = md.m[c];
    const u64 n_c = pop(c);
    if (!m || !n_c) continue;
    u64 nxt = 0;
    const int km = log2_64(m);  // m >= 1: the full remainder's truncated-binary width and threshold
    const u64 um = (u64(2) << km) - m;
    const u8* slots = md.slot + c * PROB_SCALE;
    const u32* freq = md.freq + c * NSYM;
    const u32* cum = md.cum + c * NSYM;
    for (;;) {
      u64 g;
      if (!gap_fast(rd, m, km, um, n_c - nxt, &g)) {
        bool end;
        if (!get_gap(rd, m, n_c - nxt, &g, &end)) return BITS_SHORT;
        if (end) break;
      }
      if (u64(k) >= budget) return TOO_MANY;
      rank[k] = u32(nxt + g);
      nxt += g + 1;
      if (!rerr) {
        const u32 slot = x & (PROB_SCALE - 1);
        const int s = slots[slot];
        x = freq[s] * (x >> PROB_BITS) + slot - cum[s];
        // x >= f 2^11 >= 2^11 here: at most two bytes bring it back to [2^23, 2^31). With two bytes left,
        // taken without a branch (a byte follows about one symbol in five, where no predictor can tell).
        if (at + 2 <= slen) {
          const u32 b0 = sb[at], b1 = sb[at + 1];
          const u32 one = x < RANS_L, two = x < (RANS_L >> 8);
          x = two ? (x << 16) | (b0 << 8) | b1 : one ? (x << 8) | b0 : x;
          at += one + two;
        } else {
          while (x < RANS_L) {
            if (at >= slen) {
              rerr = RANS_SHORT;
              break;
            }
            x = (x << 8) | sb[at++];
          }
        }
        d[k] = s < SMALL ? i64(s - SMALL) : s < ESC ? i64(s - SMALL + 1) : 0;
      }
      ++k;
    }
  }
  for (int c = hi; c <= NCLASS; ++c) first[c] = k;
  if (k == 0) {
    if (slen) return STEPS_NO_CHANGE;
  } else {
    if (rerr) return rerr;
    if (x != RANS_L || at != slen) return RANS_END;
    for (u32 i = 0; i < k; ++i)
      if (d[i] == 0) {
        const int e = get_escape(rd, width_bits, &d[i]);
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
  *count = k;
  return OK;
}

// Where decode_chunk's changes go when the caller wants them as two arrays (the GPU kernel): the i-th in
// position order at off[i] (offset in chunk) and step[i].
struct ToArrays {
  u32* off;
  i64* step;
  WS_HD void operator()(u32 i, u32 o, i64 d) const {
    off[i] = o;
    step[i] = d;
  }
};

// Decode one chunk of len elements against old[0..len). On success hands its *count changes to emit in
// position order, emit(i, offset in chunk, step), and returns OK; on an error emit has not been called.
// budget: changes the chunk may hold at most.
template <class T, class Emit>
WS_HD int decode_chunk(const T* old, u32 len, const u8* pb, u64 plen, const u8* sb, u64 slen, ModelView md,
                       int lo, int hi, int kind, int shift, int ebits, u64 budget, Scratch sc, Emit& emit,
                       u32* count) {
  const int width_bits = int(8 * sizeof(T));
  // Quarters start on block edges and never grow with w: when the last has a whole block at an offset, so
  // do the others, and the four are counted side by side there.
  const u32 q = ((len + WALKERS - 1) / WALKERS + BLOCK - 1) / BLOCK * BLOCK;
  u32 qa[WALKERS], qz[WALKERS];  // quarter w: [qa[w], qz[w])
  for (int w = 0; w < WALKERS; ++w) {
    qa[w] = u32(w) * q < len ? u32(w) * q : len;
    qz[w] = qa[w] + q < len ? qa[w] + q : len;
  }
  const u32 span = u32(hi - lo);  // a row of snap: the classes the model codes lie in [lo, hi)
  classes<T>(old, len, kind, shift, ebits, sc.of);
  for (int i = 0; i < WALKERS * NCLASS; ++i) sc.h[i] = 0;
  {
    u32* h = sc.h;
    const u8* of = sc.of;
    for (u32 o = 0; o < q; o += BLOCK) {
      for (int w = 0; w < WALKERS; ++w) {  // the counts so far in its quarter, at the block
        if (qa[w] + o >= qz[w]) continue;
        u32* col = sc.snap + (qa[w] + o) / BLOCK;
        const u32* hw = h + w * NCLASS + lo;
        for (u32 a = 0; a < span; ++a) col[a * SNAP_ROW] = hw[a];
      }
      if (qa[WALKERS - 1] + o + BLOCK <= qz[WALKERS - 1]) {
        const u8* c0 = of + qa[0] + o;
        const u8* c1 = of + qa[1] + o;
        const u8* c2 = of + qa[2] + o;
        const u8* c3 = of + qa[3] + o;
        for (u32 i = 0; i < BLOCK; ++i) {
          h[c0[i]]++;
          h[NCLASS + c1[i]]++;
          h[2 * NCLASS + c2[i]]++;
          h[3 * NCLASS + c3[i]]++;
        }
      } else {
        for (int w = 0; w < WALKERS; ++w) {
          const u32 stop = qa[w] + o + BLOCK < qz[w] ? qa[w] + o + BLOCK : qz[w];
          for (u32 i = qa[w] + o; i < stop; ++i) h[w * NCLASS + of[i]]++;
        }
      }
    }
  }
  u32 k = 0;
  {
    const int e = decode_codes(pb, plen, sb, slen, md, lo, hi, width_bits, budget, QuarterPop{sc.h}, sc.rank,
                               sc.d, sc.first, &k);
    if (e) return e;
  }
  // Place the changes. A class's change of rank r is its element where the class's count reaches r. The
  // block counts become counts from the chunk's start (plus the quarters before); each class moves forward
  // through the blocks as its ranks grow and selects inside the block; the marks then give position order.
  for (int c = lo; c < hi; ++c) {
    u32 before = 0;
    for (int w = 0; w < WALKERS; ++w) {
      sc.qb[w * NCLASS + c] = before;
      before += sc.h[w * NCLASS + c];
    }
  }
  const u32 nb = (len + BLOCK - 1) / BLOCK, nwords = (len + 63) / 64;
  for (u32 i = 0; i < nwords; ++i) sc.mark[i] = 0;
  for (int c = lo; c < hi; ++c) {
    if (sc.first[c] == sc.first[c + 1]) continue;  // no change of this class here: its row stays as counted
    u32* row = sc.snap + u32(c - lo) * SNAP_ROW;
    for (int w = 1; w < WALKERS; ++w) {
      const u32 add = sc.qb[w * NCLASS + c];
      if (qa[w] < qz[w])  // a quarter's blocks by index (qa[w] is a block edge): a loop the compiler widens
        for (u32 b = qa[w] / BLOCK, e = (qz[w] + BLOCK - 1) / BLOCK; b < e; ++b) row[b] += add;
    }
    u32 g = 0;
    for (u32 j = sc.first[c]; j < sc.first[c + 1]; ++j) {
      const u32 r = sc.rank[j];  // < the class's count in the chunk (get_gap)
      g = block_of(row, g, nb, r);
      const u32 from = g * BLOCK, to = from + BLOCK < len ? from + BLOCK : len;
      const u32 o = select_in(sc.of, from, to, u32(c), r - row[g]);
      if (o >= to) return PLACE;  // the block counts and the classes disagree: nothing is written past them
      sc.mark[o >> 6] |= u64(1) << (o & 63);
      sc.at[o] = u16(j);
    }
  }
  u32 i = 0;
  for (u32 wi = 0; wi < nwords; ++wi)
    for (u64 bits = sc.mark[wi]; bits; bits &= bits - 1) {
      const u32 o = wi * 64 + u32(ctz64(bits));
      emit(i, o, sc.d[sc.at[o]]);
      ++i;
    }
  *count = k;
  return OK;
}

}  // namespace v2
}  // namespace ws
