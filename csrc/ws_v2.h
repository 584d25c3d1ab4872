// Delta codec v2 on the CPU (wsync/codecs/v2_ref.py is the spec; these give the same bytes).
//
// encode: from the base and v1's sparse sections (delta_kernels.h made them in its one pass over both
// tensors) to the four v2 parts. Pass 1 walks each chunk of the base once, counting classes and taking
// each change's rank in its class; the model is summed from those; pass 2 codes each chunk. Chunks run
// on the thread pool. decode: the model and index parsed here, each chunk decoded, then back to v1
// sections, which the existing kernels apply. A chunk's counting and placing run on ws_v2_planes.h's bit
// planes where the CPU has popcnt and the chunk's classes fit its window, else on the portable code (the
// count tables below, ws_v2.cuh's decode_chunk); both give the same bytes.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "delta_kernels.h"
#include "parallel.h"
#include "streams.h"
#include "ws_v2.cuh"
#include "ws_v2_planes.h"

namespace wsync {
namespace v2 {

using namespace ws::v2;

// Chunks run on the planes (true) and on the portable code, for the tests (wsync._cpu.v2_paths).
inline std::atomic<uint64_t>& path_count(bool planes_path) {
  static std::atomic<uint64_t> n[2];
  return n[planes_path ? 1 : 0];
}

struct ClassSpec {
  int kind, shift, ebits;  // see ws::v2::value_class
};

inline void put_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(uint8_t((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(uint8_t(v));
}

// false: truncated, overlong or over limit
inline bool get_varint(const uint8_t* buf, int64_t len, int64_t& at, uint64_t limit, uint64_t& v) {
  v = 0;
  int shift = 0;
  for (int i = 0; i < 10 && at + i < len; ++i) {
    const uint8_t b = buf[at + i];
    if (shift == 63 && (b & 0x7E)) return false;
    v |= uint64_t(b & 0x7F) << shift;
    shift += 7;
    if (!(b & 0x80)) {
      at += i + 1;
      return v <= limit;
    }
  }
  return false;
}

// Least significant bit first. Each put stores the whole accumulator (8 bytes, into slack the buffer keeps)
// and moves on by the bytes it completed: no branch on how many bits are pending.
struct BitWriter {
  std::vector<uint8_t> out;
  size_t bytes = 0;  // complete bytes in out
  uint64_t acc = 0;  // pending bits (fewer than 8 between puts)
  int n = 0;
  void put(uint64_t v, int nbits) {  // nbits <= 32
    if (bytes + 16 > out.size()) out.resize(2 * out.size() + 64);
    acc |= (v & ((uint64_t(1) << nbits) - 1)) << n;
    n += nbits;
    std::memcpy(&out[bytes], &acc, 8);
    bytes += size_t(n >> 3);
    acc >>= (n & ~7);
    n &= 7;
  }
  void ones(uint64_t count) {
    for (; count >= 32; count -= 32) put(0xFFFFFFFFu, 32);
    put((uint64_t(1) << count) - 1, int(count));
  }
  void finish() { out.resize(bytes + (n ? 1 : 0)); }  // the last partial byte is stored, its spare bits zero
};

inline int floor_log2(uint64_t s) { return 63 - __builtin_clzll(s); }

// v in [0, s) in truncated binary: k = floor(log2 s) bits, or k + 1 for the top values. As one field of
// *len bits (least significant first, as the reader takes them; len <= 33).
inline uint64_t truncated(uint64_t v, uint64_t s, int* len) {
  const int k = floor_log2(s);  // s == 1: k = 0 and u = 1 > v, so no bits
  const uint64_t u = (uint64_t(2) << k) - s;
  const bool top = v >= u;  // a select, not a branch the data would mispredict
  *len = k + int(top);
  const uint64_t w = v + u;
  return top ? (w >> 1) | ((w & 1) << k) : v;
}

// g < r: q = g / m ones (the caller divides), a zero, then g - q * m in truncated binary over min(m, r - q * m);
// in one put when the code fits 32 bits, as it nearly always does.
inline void put_gap(BitWriter& w, uint64_t g, uint64_t m, uint64_t r, uint64_t q) {
  int len;
  const uint64_t rest = truncated(g - q * m, std::min(m, r - q * m), &len);
  if (q + 1 + uint64_t(len) <= 32) {
    w.put(((uint64_t(1) << q) - 1) | (rest << (q + 1)), int(q) + 1 + len);
    return;
  }
  w.ones(q);
  w.put(0, 1);
  w.put(rest, std::min(len, 32));
  if (len > 32) w.put(rest >> 32, len - 32);
}

inline void put_end(BitWriter& w, uint64_t m, uint64_t r) { w.ones((r + m - 1) / m); }

inline void put_escape(BitWriter& w, int64_t d) {
  w.put(d < 0 ? 1 : 0, 1);
  const uint64_t v = (d < 0 ? uint64_t(0) - uint64_t(d) : uint64_t(d)) - SMALL;
  const int n = floor_log2(v);
  for (int z = n; z > 0; z -= std::min(z, 32)) w.put(0, std::min(z, 32));
  w.put(1, 1);
  if (n > 32) {
    w.put(v & 0xFFFFFFFFu, 32);
    w.put((v >> 32) & ((uint64_t(1) << (n - 32)) - 1), n - 32);
  } else {
    w.put(v & ((uint64_t(1) << n) - 1), n);
  }
}

inline uint64_t golomb_param(uint64_t n, uint64_t k) {
  return k == 0 ? 0 : std::max<uint64_t>(1, (n * 2839 + k * 2048) / (k * 4096));
}

inline void quantize(const uint64_t* counts, uint32_t* f) {
  uint64_t total = 0;
  for (int s = 0; s < NSYM; ++s) total += counts[s];
  int top = 0;
  int64_t sum = 0;
  for (int s = 0; s < NSYM; ++s) {
    f[s] = counts[s] == 0 ? 0 : uint32_t(std::max<uint64_t>(1, counts[s] * PROB_SCALE / total));
    sum += f[s];
    if (counts[s] > counts[top]) top = s;
  }
  f[top] = uint32_t(int64_t(f[top]) + int64_t(PROB_SCALE) - sum);
}

// -7..-1 -> 0..6, 1..7 -> 7..13, else ESC; with selects (a step's sign is a coin toss to a predictor)
inline int symbol(int64_t d) {
  const uint64_t u = uint64_t(d) + SMALL;  // d in [-7, 7]: u in [0, 14]
  return u <= 2 * SMALL && d != 0 ? int(u) - int(d > 0) : ESC;
}

// The base's chunk c (len elements) as a pointer: into the stream where the chunk lies in one piece, else
// gathered into buf (a multi-tensor segment's chunks run across tensors).
template <class T>
const T* chunk_of(const Stream& s, int64_t n, int64_t c, std::vector<T>& buf) {
  const int64_t b0 = c * kChunk * int64_t(sizeof(T)), b1 = b0 + chunk_len(n, c) * int64_t(sizeof(T));
  const int64_t i = s.find(b0);
  if (i < s.n && b1 <= s.starts[i + 1]) return at<const T>(s.base(i), b0);
  buf.resize(size_t(kChunk));
  for_pieces(s, b0, b1, [&](uintptr_t base, int64_t lo, int64_t hi) {
    std::memcpy(reinterpret_cast<uint8_t*>(buf.data()) + (lo - b0), at<const uint8_t>(base, lo), size_t(hi - lo));
  });
  return buf.data();
}

struct Parts {
  std::vector<uint8_t> model, index, pos, steps;
};

// Per change, what pass 1 learns: offset in chunk, class, rank in class, step.
struct Change {
  uint32_t off, rank;
  uint16_t cls;
  uint8_t sym;  // symbol(d)
  int64_t d;
};

// The steps of v1 sections, chunk by chunk: d = key(new) - key(old) for escapes.
template <class T, int O>
void chunk_changes(const T* base, int64_t n, int64_t c, const uint32_t* table, const int64_t* offsets,
                   const uint8_t* gaps, const int8_t* steps, const uint8_t* escapes, std::vector<Change>& out) {
  const int64_t nc = nchunks(n);
  const int64_t k0 = offsets[c], cnt = table[c];
  int64_t e = offsets[nc + c];
  int64_t o = -1;
  out.resize(size_t(cnt));
  using S = std::make_signed_t<T>;
  for (int64_t i = 0; i < cnt; ++i) {
    o += int64_t(load<uint16_t>(gaps, k0 + i)) + 1;
    int64_t d = steps[k0 + i];
    if (d == kEscape) {
      const T nv = load<T>(escapes, e++);
      d = int64_t(S(T(key<T, O>(nv) - key<T, O>(base[o]))));
    }
    out[size_t(i)] = Change{uint32_t(o), 0, 0, uint8_t(symbol(d)), d};
  }
}

// rANS encoding of one symbol of frequency f (> 0) and cumulative frequency cum: x / f and x % f from one
// multiply. For x < 2^31 and f <= 2^12, floor(x * (floor(2^43 / f) + 1) / 2^43) is floor(x / f): the
// reciprocal's error, at most f / 2^43 per unit, stays below 1 / 2^12 over x's range.
struct RansSym {
  uint64_t rcp;
  uint32_t f, cum;
};

inline RansSym rans_sym(uint32_t f, uint32_t cum) { return RansSym{f ? (uint64_t(1) << 43) / f + 1 : 0, f, cum}; }

inline uint32_t rans_put(uint32_t x, const RansSym& s) {
  const uint32_t q = uint32_t((unsigned __int128)x * s.rcp >> 43);
  return (q << PROB_BITS) + (x - q * s.f) + s.cum;
}

// Pass 2 of one chunk: its changes (offset order, with class and rank) to the position bitstream and the
// rANS stream. by_cls: scratch for the changes in class order.
inline void code_chunk(const std::vector<Change>& v, const uint32_t* pop, int lo, int hi, const uint64_t* m,
                       const RansSym* sym, std::vector<Change>& by_cls, std::vector<uint8_t>& pos,
                       std::vector<uint8_t>& steps) {
  // class order, stable: a counting sort over the classes [lo, hi)
  uint32_t start[NCLASS + 1] = {};
  for (const Change& x : v) start[x.cls + 1]++;
  for (int k = 0; k < NCLASS; ++k) start[k + 1] += start[k];
  by_cls.resize(v.size());
  for (const Change& x : v) by_cls[start[x.cls]++] = x;
  BitWriter w;
  w.out.resize(2 * v.size() + 64);
  size_t i = 0;
  bool escapes = false;
  for (int k = lo; k < hi; ++k) {
    if (!m[k] || !pop[k]) continue;
    const uint64_t mk = m[k], pk = pop[k];
    // The gaps are < 2^16 (ranks in a chunk): with m past that, every quotient is 0; else a 32-bit divide.
    const uint32_t m32 = mk > 0xFFFF ? 0 : uint32_t(mk);
    uint64_t nxt = 0;
    for (; i < by_cls.size() && by_cls[i].cls == k; ++i) {
      const uint64_t g = by_cls[i].rank - nxt;
      put_gap(w, g, mk, pk - nxt, m32 ? uint32_t(g) / m32 : 0);
      escapes |= by_cls[i].sym == ESC;
      nxt = by_cls[i].rank + 1;
    }
    put_end(w, mk, pk - nxt);
  }
  if (escapes)
    for (const Change& x : by_cls)
      if (x.sym == ESC) put_escape(w, x.d);
  w.finish();
  pos = std::move(w.out);
  steps.clear();
  if (by_cls.empty()) return;
  // rANS runs backwards over the changes; its bytes are written from the end of steps back (at most two a
  // change: a state below 2^31 is under 2^19 f after two), then moved to the front
  steps.resize(2 * by_cls.size() + 4);
  uint8_t* const end = steps.data() + steps.size();
  uint8_t* p = end;
  uint32_t x = RANS_L;
  for (size_t j = by_cls.size(); j-- > 0;) {
    const RansSym& s = sym[size_t(by_cls[j].cls) * NSYM + by_cls[j].sym];
    const uint32_t x_max = ((RANS_L >> PROB_BITS) << 8) * s.f;
    while (x >= x_max) {
      *--p = uint8_t(x);
      x >>= 8;
    }
    x = rans_put(x, s);
  }
  for (int b = 0; b < 4; ++b) *--p = uint8_t(x >> (24 - 8 * b));
  const size_t n = size_t(end - p);
  std::memmove(steps.data(), p, n);
  steps.resize(n);
}

template <class T, int O>
bool encode(const Stream& old, int64_t n, const uint32_t* table, const uint8_t* gaps, const int8_t* steps,
            const uint8_t* escapes, ClassSpec cs, Parts& parts) {
  const int64_t nc = nchunks(n);
  std::vector<int64_t> offsets(static_cast<size_t>(2 * nc));
  int64_t total, total_esc;
  table_offsets(table, nc, offsets.data(), &total, &total_esc);
  std::vector<std::vector<Change>> ch(static_cast<size_t>(nc));
  std::vector<uint32_t> pops(static_cast<size_t>(nc * NCLASS));
  // pass 1: each chunk's changes with their class and rank; the chunk's class counts. The classes of the
  // chunk in one vectorised loop, then counted in four tables (count_bytes4, elements dealt in turn) so that four
  // increments are in flight at once; a change's rank is its class's count in all four when it is reached.
  // Chunks run in groups, each summing the model's counts (per class: elements, changes, symbols) for its
  // chunks while they are at hand.
  const int64_t ngroups = std::min<int64_t>(nc, 64), per = (nc + ngroups - 1) / ngroups;
  const size_t stride = size_t(NCLASS) * (NSYM + 2);
  std::vector<uint64_t> acc(size_t(ngroups) * stride);
  parallel_for(ngroups, 1, [&](int64_t grp) {
    uint64_t* a = &acc[size_t(grp) * stride];
    thread_local std::vector<T> gathered;
    thread_local std::vector<uint8_t> of;
    of.resize(size_t(kChunk));
    for (int64_t c = grp * per; c < std::min(nc, (grp + 1) * per); ++c) {
      std::vector<Change>& v = ch[size_t(c)];
      const T* base = chunk_of<T>(old, n, c, gathered);
      chunk_changes<T, O>(base, n, c, table, offsets.data(), gaps, steps, escapes, v);
      const uint32_t len = uint32_t(chunk_len(n, c));
#if WS_V2_PLANES
      if (planes::enabled()) {
        planes::Planes& pl = planes::scratch();
        if (planes::rank_changes<T>(base, len, cs.kind, cs.shift, cs.ebits, of.data(), pl, v.data(), v.size())) {
          uint32_t* pop = &pops[size_t(c * NCLASS)];
          for (int k = 0; k < NCLASS; ++k) pop[k] = uint32_t(pl.pop(k));
          for (const Change& x : v) {
            uint64_t* row = a + size_t(x.cls) * (NSYM + 2);
            row[1]++;
            row[2 + x.sym]++;
          }
          for (int k = 0; k < NCLASS; ++k) a[size_t(k) * (NSYM + 2)] += pop[k];
          path_count(true).fetch_add(1, std::memory_order_relaxed);
          continue;
        }
      }
#endif
      path_count(false).fetch_add(1, std::memory_order_relaxed);
      classes<T>(base, len, cs.kind, cs.shift, cs.ebits, of.data());
      const uint8_t* cl = of.data();
      uint32_t h[4][NCLASS] = {};
      uint32_t o = 0;
      auto count_to = [&](uint32_t end) {
        planes::count_bytes4(cl, o, end, h);
        o = end;
      };
      for (Change& x : v) {
        count_to(x.off);
        x.cls = cl[x.off];
        x.rank = h[0][x.cls] + h[1][x.cls] + h[2][x.cls] + h[3][x.cls];
        uint64_t* row = a + size_t(x.cls) * (NSYM + 2);
        row[1]++;
        row[2 + x.sym]++;
      }
      count_to(len);
      uint32_t* pop = &pops[size_t(c * NCLASS)];
      for (int k = 0; k < NCLASS; ++k) {
        pop[k] = h[0][k] + h[1][k] + h[2][k] + h[3][k];
        a[size_t(k) * (NSYM + 2)] += pop[k];
      }
    }
  });
  // the model
  std::vector<uint64_t> n_c(NCLASS), k_c(NCLASS), counts(size_t(NCLASS) * NSYM);
  for (int64_t g = 0; g < ngroups; ++g)
    for (int k = 0; k < NCLASS; ++k) {
      const uint64_t* row = &acc[size_t(g) * stride + size_t(k) * (NSYM + 2)];
      n_c[size_t(k)] += row[0];
      k_c[size_t(k)] += row[1];
      for (int j = 0; j < NSYM; ++j) counts[size_t(k) * NSYM + size_t(j)] += row[2 + j];
    }
  std::vector<uint64_t> m(NCLASS);
  std::vector<uint32_t> freq(size_t(NCLASS) * NSYM);
  std::vector<RansSym> sym(size_t(NCLASS) * NSYM);
  int lo = NCLASS, hi = 0;
  for (int k = 0; k < NCLASS; ++k) {
    m[size_t(k)] = golomb_param(n_c[size_t(k)], k_c[size_t(k)]);
    if (!m[size_t(k)]) continue;
    lo = std::min(lo, k);
    hi = k + 1;
    quantize(&counts[size_t(k) * NSYM], &freq[size_t(k) * NSYM]);
    uint32_t s = 0;
    for (int j = 0; j < NSYM; ++j) {
      sym[size_t(k) * NSYM + size_t(j)] = rans_sym(freq[size_t(k) * NSYM + size_t(j)], s);
      s += freq[size_t(k) * NSYM + size_t(j)];
    }
  }
  if (lo > hi) lo = hi = 0;
  parts.model.clear();
  put_varint(parts.model, uint64_t(total));
  put_varint(parts.model, uint64_t(lo));
  put_varint(parts.model, uint64_t(hi));
  for (int k = lo; k < hi; ++k) {
    put_varint(parts.model, m[size_t(k)]);
    if (m[size_t(k)])
      for (int j = 0; j < NSYM; ++j) put_varint(parts.model, freq[size_t(k) * NSYM + size_t(j)]);
  }
  // pass 2: each chunk's position bitstream and rANS stream
  std::vector<std::vector<uint8_t>> pos_out(static_cast<size_t>(nc)), steps_out(static_cast<size_t>(nc));
  parallel_for(nc, 1, [&](int64_t c) {
    thread_local std::vector<Change> by_cls;
    code_chunk(ch[size_t(c)], &pops[size_t(c * NCLASS)], lo, hi, m.data(), sym.data(), by_cls, pos_out[size_t(c)],
               steps_out[size_t(c)]);
  });
  parts.index.clear();
  parts.pos.clear();
  parts.steps.clear();
  for (int64_t c = 0; c < nc; ++c) {
    put_varint(parts.index, pos_out[size_t(c)].size());
    put_varint(parts.index, steps_out[size_t(c)].size());
    parts.pos.insert(parts.pos.end(), pos_out[size_t(c)].begin(), pos_out[size_t(c)].end());
    parts.steps.insert(parts.steps.end(), steps_out[size_t(c)].begin(), steps_out[size_t(c)].end());
  }
  return true;
}

// ---- decode ------------------------------------------------------------------------------

struct Decoded {  // v1 sections
  std::vector<uint32_t> table;
  std::vector<uint16_t> gaps;
  std::vector<int8_t> steps;
  std::vector<uint8_t> escapes;  // uW little-endian
};

inline const char* err_text(int e) {
  switch (e) {
    case BITS_SHORT: return "position bitstream ends early";
    case BITS_LEFT: return "bits left over after the last code";
    case TOO_MANY: return "more changes than the model declares";
    case STEPS_NO_CHANGE: return "steps for a chunk without changes";
    case RANS_SHORT: return "rANS stream ends early";
    case RANS_STATE: return "rANS state outside [2^23, 2^31)";
    case RANS_END: return "rANS stream does not end where it should (corrupt)";
    case ESC_LONG: return "escape longer than a step of this width";
    case ESC_RANGE: return "escape step does not fit the element";
    case PLACE: return "a change has no element to sit at";
  }
  return "corrupt";
}

// Parses and checks the model (as v2_ref.read_model); false with a message.
inline bool read_model(const uint8_t* buf, int64_t len, int64_t numel, int width, uint64_t& k, int& lo, int& hi,
                       Model& md, std::string& err) {
  int64_t at = 0;
  uint64_t v;
  if (!get_varint(buf, len, at, uint64_t(numel), v)) return err = "v2 model: bad change count", false;
  k = v;
  if (k == 0 || 8 * nchunks(numel) + 3 * int64_t(k) >= numel * width)
    return err = "v2 model: " + std::to_string(k) + " changes in " + std::to_string(numel) +
                 " elements is too dense for a delta, or none", false;
  uint64_t l, h;
  if (!get_varint(buf, len, at, NCLASS, l) || !get_varint(buf, len, at, NCLASS, h) || l > h)
    return err = "v2 model: bad class range", false;
  lo = int(l);
  hi = int(h);
  for (int c = 0; c < NCLASS; ++c) md.m[c] = 0;
  for (int c = lo; c < hi; ++c) {
    uint64_t mc;
    if (!get_varint(buf, len, at, uint64_t(1) << 32, mc))
      return err = "v2 model class " + std::to_string(c) + ": bad Golomb parameter", false;
    md.m[c] = mc;
    if (!md.m[c]) continue;
    uint32_t sum = 0;
    for (int s = 0; s < NSYM; ++s) {
      if (!get_varint(buf, len, at, PROB_SCALE, v))
        return err = "v2 model class " + std::to_string(c) + ": bad frequency", false;
      md.freq[c][s] = uint32_t(v);
      md.cum[c][s] = sum;
      sum += uint32_t(v);
    }
    if (sum != PROB_SCALE)
      return err = "v2 model class " + std::to_string(c) + ": frequencies sum to " + std::to_string(sum), false;
    for (int s = 0; s < NSYM; ++s)
      std::fill(md.slot[c] + md.cum[c][s], md.slot[c] + md.cum[c][s] + md.freq[c][s], uint8_t(s));
  }
  if (at != len) return err = "v2 model: bytes after the last class", false;
  return true;
}

template <class T, int O>
bool decode(const Stream& old, int64_t n, const uint8_t* model, int64_t model_len, const uint8_t* index,
            int64_t index_len, const uint8_t* pos, int64_t pos_len, const uint8_t* steps, int64_t steps_len,
            ClassSpec cs, Decoded& out, std::string& err) {
  const int W = int(sizeof(T));
  uint64_t k;
  int lo, hi;
  // The model (1 MiB, mostly slot tables) is the calling thread's, kept between calls: a fresh one per
  // tensor cost an mmap and a page fault per slot table. read_model sets every class it leaves uncoded to
  // m = 0, so nothing of an earlier tensor's model is read.
  thread_local std::unique_ptr<Model> md;
  if (!md) md.reset(new Model);
  if (!read_model(model, model_len, n, W, k, lo, hi, *md, err)) return false;
  const ModelView mv{md->m, &md->freq[0][0], &md->cum[0][0], &md->slot[0][0]};
  const int64_t nc = nchunks(n);
  std::vector<int64_t> pa(static_cast<size_t>(nc + 1)), sa(static_cast<size_t>(nc + 1));
  int64_t at = 0;
  for (int64_t c = 0; c < nc; ++c) {
    uint64_t a, b;
    if (!get_varint(index, index_len, at, uint64_t(pos_len), a) ||
        !get_varint(index, index_len, at, uint64_t(steps_len), b) || pa[size_t(c)] + int64_t(a) > pos_len ||
        sa[size_t(c)] + int64_t(b) > steps_len)
      return err = "v2 index: chunk lengths do not tile the position and step sections", false;
    pa[size_t(c + 1)] = pa[size_t(c)] + int64_t(a);
    sa[size_t(c + 1)] = sa[size_t(c)] + int64_t(b);
  }
  if (at != index_len || pa[size_t(nc)] != pos_len || sa[size_t(nc)] != steps_len)
    return err = "v2 index: chunk lengths do not tile the position and step sections", false;
  // per chunk, its v1 sections: gaps, i8 steps, escaped new values
  std::vector<std::vector<uint16_t>> gs(static_cast<size_t>(nc));
  std::vector<std::vector<int8_t>> ss(static_cast<size_t>(nc));
  std::vector<std::vector<T>> es(static_cast<size_t>(nc));
  std::vector<int> errs(static_cast<size_t>(nc), 0);
  std::atomic<uint64_t> used{0};
  // One chunk with at most budget changes: its sections into gs, ss, es, its error into errs; the count.
  auto run = [&](int64_t c, uint64_t budget) -> uint32_t {
    const uint32_t len = uint32_t(chunk_len(n, c));
    // scratch per thread, a chunk's worth; a chunk keeps only what it decoded, and at most what is left of K
    thread_local std::vector<uint32_t> rank, snap;
    thread_local std::vector<uint8_t> of;
    thread_local std::vector<ws::i64> d;
    thread_local std::vector<ws::u16> at, gap;
    thread_local std::vector<int8_t> st;
    thread_local std::vector<ws::u64> mark;
    thread_local std::vector<T> gathered;
    rank.resize(kChunk), of.resize(kChunk), d.resize(kChunk), gap.resize(kChunk);
    st.resize(kChunk), snap.resize(SNAP_ROW * NCLASS), at.resize(kChunk), mark.resize(kChunk / 64);
    uint32_t first[NCLASS + 1], h[WALKERS * NCLASS], qb[WALKERS * NCLASS];
    Scratch sc{rank.data(), d.data(), first, h, qb, of.data(), snap.data(), mark.data(), at.data()};
    const T* base = chunk_of<T>(old, n, c, gathered);
    std::vector<T>& esc = es[size_t(c)];
    // Each change straight into v1's sections as decode_chunk hands it over in position order: the gap
    // from the one before, the i8 step, or an escape (the new value) where the step does not fit.
    struct ToSections {
      uint16_t* gap;
      int8_t* st;
      std::vector<T>* esc;
      const T* base;
      int64_t prev;
      void operator()(uint32_t i, uint32_t o, int64_t dd) {
        gap[i] = uint16_t(int64_t(o) - prev - 1);
        prev = o;
        if (dd >= -127 && dd <= 127) {
          st[i] = int8_t(dd);
        } else {
          st[i] = kEscape;
          esc->push_back(unkey<T, O>(T(key<T, O>(base[o]) + T(uint64_t(dd)))));
        }
      }
    } emit{gap.data(), st.data(), &esc, base, -1};
    uint32_t count = 0;
    esc.clear();
    const uint8_t* pb = pos + pa[size_t(c)];
    const uint8_t* sb = steps + sa[size_t(c)];
    const uint64_t plen = uint64_t(pa[size_t(c + 1)] - pa[size_t(c)]);
    const uint64_t slen = uint64_t(sa[size_t(c + 1)] - sa[size_t(c)]);
    int e = planes::FALLBACK;
#if WS_V2_PLANES
    if (planes::enabled())
      e = planes::decode_chunk<T>(base, len, pb, plen, sb, slen, mv, lo, hi, cs.kind, cs.shift, cs.ebits, budget, sc,
                                  planes::scratch(), emit, &count);
#endif
    path_count(e != planes::FALLBACK).fetch_add(1, std::memory_order_relaxed);
    if (e == planes::FALLBACK)
      e = decode_chunk<T>(base, len, pb, plen, sb, slen, mv, lo, hi, cs.kind, cs.shift, cs.ebits, budget, sc, emit,
                          &count);
    errs[size_t(c)] = e;
    if (e) return 0;
    gs[size_t(c)].assign(gap.data(), gap.data() + count);
    ss[size_t(c)].assign(st.data(), st.data() + count);
    return count;
  };
  // In parallel a chunk's budget is what the chunks that happened to finish first left of K, so which error
  // a bad payload gets would depend on the schedule; it only stops a chunk early.
  parallel_for(nc, 1, [&](int64_t c) { used += run(c, k - std::min<uint64_t>(k, used.load())); });
  uint64_t got = 0;
  for (int64_t c = 0; c < nc; ++c) got += errs[size_t(c)] ? 0 : gs[size_t(c)].size();
  if (got != k || std::any_of(errs.begin(), errs.end(), [](int e) { return e != 0; })) {
    // A bad payload: decoded again in chunk order, each chunk's budget what the chunks before it left, as
    // the reference does, so the error is the reference's and the same on every run.
    got = 0;
    for (int64_t c = 0; c < nc; ++c) {
      got += run(c, k - std::min<uint64_t>(k, got));
      if (errs[size_t(c)]) return err = "v2 chunk " + std::to_string(c) + ": " + err_text(errs[size_t(c)]), false;
    }
    if (got != k)
      return err = "v2: decoded " + std::to_string(got) + " changes, the model declares " + std::to_string(k), false;
  }
  uint64_t got_esc = 0;
  for (int64_t c = 0; c < nc; ++c) got_esc += es[size_t(c)].size();
  out.table.assign(static_cast<size_t>(2 * nc), 0);
  out.gaps.resize(size_t(k));
  out.steps.resize(size_t(k));
  out.escapes.resize(size_t(got_esc) * sizeof(T));
  size_t j = 0, e = 0;
  for (int64_t c = 0; c < nc; ++c) {
    const size_t cnt = gs[size_t(c)].size(), ne = es[size_t(c)].size();
    std::memcpy(&out.gaps[j], gs[size_t(c)].data(), cnt * 2);
    std::memcpy(&out.steps[j], ss[size_t(c)].data(), cnt);
    if (ne) std::memcpy(&out.escapes[e * sizeof(T)], es[size_t(c)].data(), ne * sizeof(T));
    out.table[size_t(c)] = uint32_t(cnt);
    out.table[size_t(nc + c)] = uint32_t(ne);
    j += cnt;
    e += ne;
  }
  return true;
}

}  // namespace v2
}  // namespace wsync
