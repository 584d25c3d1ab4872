// wsync._cpu: the C++ CPU backend's Python module (raw CPython API, no numpy or
// torch headers, so it builds against any numpy and needs only a C++ compiler).
//
// Functions take anything with the buffer protocol and return bytearrays that
// wsync/backends/cpu.py views as numpy arrays without a copy. The kernels run
// with the GIL released. Invalid delta sections raise _cpu.InvalidSections,
// which the Python side turns into wsync.errors.FormatError.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "checksum_kernels.h"
#include "delta_kernels.h"
#include "ws_lora.cuh"  // the lowrank range finder, shared with the CUDA kernel
#include "ws_quant.cuh"  // the quantizers of wsync.quant, shared with the CUDA kernels

// delta v2, in csrc/ws_v2_cpu.cpp
PyObject* ws_v2_py_encode(PyObject*, PyObject* args);
PyObject* ws_v2_py_decode(PyObject*, PyObject* args);
PyObject* ws_v2_py_paths(PyObject*, PyObject*);

namespace {

PyObject* InvalidSections = nullptr;

// A Py_buffer released on scope exit, so every early return is leak-free.
struct Buffer {
  Py_buffer view{};
  bool held = false;
  ~Buffer() {
    if (held) PyBuffer_Release(&view);
  }
  // C-contiguous bytes of obj, writable if asked; sets a Python error on failure.
  bool get(PyObject* obj, bool writable = false) {
    held = PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) == 0;
    return held;
  }
  const uint8_t* data() const { return static_cast<const uint8_t*>(view.buf); }
  uint8_t* writable_data() const { return static_cast<uint8_t*>(view.buf); }  // only after get(obj, true)
  int64_t size() const { return int64_t(view.len); }
};

// Call f(T{}) with T the unsigned type of an element width the caller has checked (1, 2, 4 or 8 bytes).
template <class F>
void by_width(int width, F&& f) {
  switch (width) {
    case 1: f(uint8_t{}); break;
    case 2: f(uint16_t{}); break;
    case 4: f(uint32_t{}); break;
    default: f(uint64_t{}); break;
  }
}

int parse_order(const char* s) {
  if (!std::strcmp(s, "float")) return wsync::kFloat;
  if (!std::strcmp(s, "int")) return wsync::kInt;
  if (!std::strcmp(s, "uint")) return wsync::kUint;
  return -1;
}

// Width and order arguments are the caller's, not the payload's: bad ones are
// programming errors (ValueError), not format errors.
bool check_kind(int width, int order, const char* order_name) {
  if (width != 1 && width != 2 && width != 4 && width != 8) {
    PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8 bytes, got %d", width);
    return false;
  }
  if (order < 0) {
    PyErr_Format(PyExc_ValueError, "order must be 'float', 'int' or 'uint', got '%s'", order_name);
    return false;
  }
  return true;
}

// A section's element count, or -1 with a ValueError if its bytes do not divide.
int64_t elements(const Buffer& b, int64_t itemsize, const char* what) {
  if (b.size() % itemsize) {
    PyErr_Format(PyExc_ValueError, "%s: %lld bytes is not a whole number of %lld-byte elements", what,
                 (long long)b.size(), (long long)itemsize);
    return -1;
  }
  return b.size() / itemsize;
}

// ---- streams -----------------------------------------------------------------

// A bits argument: a buffer, or a table (addrs, starts) of int64 buffers
// describing pieces back to back (wsync/tables.py). Either way the kernels
// see a wsync::Stream; a buffer is a stream of one piece. Not copyable: the
// stream of a buffer points into this object.
struct StreamArg {
  Buffer buf, addrs_b, starts_b;
  int64_t one_addr = 0, one_starts[2] = {0, 0};
  wsync::Stream s;
  bool table = false;

  StreamArg() = default;
  StreamArg(const StreamArg&) = delete;
  StreamArg& operator=(const StreamArg&) = delete;

  // width > 0: every piece must hold whole elements of that many bytes. The
  // pieces' addresses come from wsync's own code and are trusted; writable
  // is checked for buffers only (the Python side checks a table's pieces).
  bool get(PyObject* obj, const char* what, int width, bool writable = false) {
    if (PyTuple_Check(obj)) {
      table = true;
      if (PyTuple_GET_SIZE(obj) != 2) {
        PyErr_Format(PyExc_TypeError, "%s: a table is a 2-tuple (addrs, starts), got %zd items", what,
                     PyTuple_GET_SIZE(obj));
        return false;
      }
      if (!int64s(addrs_b, PyTuple_GET_ITEM(obj, 0), what, "addrs") ||
          !int64s(starts_b, PyTuple_GET_ITEM(obj, 1), what, "starts"))
        return false;
      const int64_t n = addrs_b.size() / 8;
      const int64_t* st = reinterpret_cast<const int64_t*>(starts_b.data());
      if (starts_b.size() / 8 != n + 1) {
        PyErr_Format(PyExc_ValueError, "%s: %lld piece addresses need %lld starts, got %lld", what, (long long)n,
                     (long long)(n + 1), (long long)(starts_b.size() / 8));
        return false;
      }
      if (st[0] != 0) {
        PyErr_Format(PyExc_ValueError, "%s: starts[0] must be 0, got %lld", what, (long long)st[0]);
        return false;
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t len = st[i + 1] - st[i];
        if (len < 0) {
          PyErr_Format(PyExc_ValueError, "%s: starts decrease at piece %lld (%lld -> %lld)", what, (long long)i,
                       (long long)st[i], (long long)st[i + 1]);
          return false;
        }
        if (width > 0 && len % width) {
          PyErr_Format(PyExc_ValueError, "%s: piece %lld has %lld bytes, not a whole number of %d-byte elements",
                       what, (long long)i, (long long)len, width);
          return false;
        }
      }
      s.addrs = reinterpret_cast<const int64_t*>(addrs_b.data());
      s.starts = st;
      s.n = n;
      return true;
    }
    if (!buf.get(obj, writable)) return false;
    if (width > 0 && buf.size() % width) {
      PyErr_Format(PyExc_ValueError, "%s: %lld bytes is not a whole number of %lld-byte elements", what,
                   (long long)buf.size(), (long long)width);
      return false;
    }
    one_addr = int64_t(reinterpret_cast<uintptr_t>(buf.view.buf));
    one_starts[1] = buf.size();
    s.addrs = &one_addr;
    s.starts = one_starts;
    s.n = 1;
    return true;
  }

  int64_t size() const { return s.bytes(); }

  // True if both are plain buffers whose bytes overlap (tables are trusted).
  bool overlaps(const StreamArg& o) const {
    if (table || o.table || !size() || !o.size()) return false;
    return buf.data() < o.buf.data() + o.size() && o.buf.data() < buf.data() + size();
  }

 private:
  static bool int64s(Buffer& b, PyObject* obj, const char* what, const char* part) {
    if (PyObject_GetBuffer(obj, &b.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return false;
    b.held = true;
    const char* f = b.view.format ? b.view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    if (b.view.itemsize != 8 || (std::strcmp(f, "q") && std::strcmp(f, "l"))) {
      PyErr_Format(PyExc_TypeError, "%s: table %s must be int64, got format '%s'", what, part,
                   b.view.format ? b.view.format : "B");
      return false;
    }
    return true;
  }
};

// ---- checksum ---------------------------------------------------------------

PyObject* py_checksum(PyObject*, PyObject* arg) {
  StreamArg b;
  if (!b.get(arg, "buf", 0)) return nullptr;
  uint64_t h;
  Py_BEGIN_ALLOW_THREADS
  h = wsync::tree_checksum(b.s);
  Py_END_ALLOW_THREADS
  return PyLong_FromUnsignedLongLong(h);
}

// ---- encode -----------------------------------------------------------------

// Bytearrays are released on scope exit unless handed to Python with release().
struct Owned {
  PyObject* obj = nullptr;
  ~Owned() { Py_XDECREF(obj); }
  bool alloc(int64_t nbytes) {  // uninitialised storage: every byte gets written before it is read
    obj = PyByteArray_FromStringAndSize(nullptr, Py_ssize_t(nbytes));
    return obj != nullptr;
  }
  uint8_t* bytes() const { return reinterpret_cast<uint8_t*>(PyByteArray_AS_STRING(obj)); }
  PyObject* release() {
    PyObject* o = obj;
    obj = nullptr;
    return o;
  }
};

// The staging area of pass 1, or null if it cannot be had (pass 2 then re-scans).
// Only the pages that changes land in are ever touched.
std::unique_ptr<uint8_t[]> staging(int64_t nc, int width) {
  return std::unique_ptr<uint8_t[]>(new (std::nothrow) uint8_t[size_t(nc * wsync::kStage * (3 + width))]);
}

PyObject* py_delta_encode(PyObject*, PyObject* args) {
  PyObject *old_obj, *new_obj;
  int width, with_checksums = 0;  // 0: none, 1: old and new, 2: new only (old's is returned as None)
  const char* order_name;
  if (!PyArg_ParseTuple(args, "OOis|i:delta_encode", &old_obj, &new_obj, &width, &order_name, &with_checksums))
    return nullptr;
  if (with_checksums < 0 || with_checksums > 2) {
    PyErr_Format(PyExc_ValueError, "checksums must be 0, 1 or 2, got %d", with_checksums);
    return nullptr;
  }
  const int order = parse_order(order_name);
  if (!check_kind(width, order, order_name)) return nullptr;
  StreamArg a, b;
  if (!a.get(old_obj, "old", width) || !b.get(new_obj, "new", width)) return nullptr;
  const int64_t n = a.size() / width;
  if (a.size() != b.size()) {
    PyErr_Format(PyExc_ValueError, "old and new differ in size: %lld vs %lld bytes", (long long)a.size(),
                 (long long)b.size());
    return nullptr;
  }
  const int64_t nc = wsync::nchunks(n), nb = with_checksums ? wsync::nblocks(a.size()) : 0;
  Owned table, gaps, steps, escapes;
  if (!table.alloc(8 * nc)) return nullptr;
  uint32_t* t = reinterpret_cast<uint32_t*>(table.bytes());  // bytearray storage is malloc-aligned
  std::unique_ptr<uint8_t[]> stage = staging(nc, width);
  std::vector<uint64_t> old_digests(static_cast<size_t>(nb)), new_digests(static_cast<size_t>(nb));
  Py_BEGIN_ALLOW_THREADS
  wsync::dispatch(width, order, [&](auto zero, auto o) {
    wsync::encode_pass1<decltype(zero), decltype(o)::value>(a.s, b.s, n, t, stage.get(),
                                                           nb && with_checksums == 1 ? old_digests.data() : nullptr,
                                                           nb ? new_digests.data() : nullptr);
  });
  Py_END_ALLOW_THREADS

  std::vector<int64_t> offsets(static_cast<size_t>(2 * nc));
  int64_t total, total_esc;
  wsync::table_offsets(t, nc, offsets.data(), &total, &total_esc);
  if (!gaps.alloc(2 * total) || !steps.alloc(total) || !escapes.alloc(width * total_esc)) return nullptr;
  bool ok = true;
  Py_BEGIN_ALLOW_THREADS
  wsync::dispatch(width, order, [&](auto zero, auto o) {
    ok = wsync::encode_pass2<decltype(zero), decltype(o)::value>(
        a.s, b.s, n, t, offsets.data(), stage.get(), gaps.bytes(),
        reinterpret_cast<int8_t*>(steps.bytes()), escapes.bytes());
  });
  Py_END_ALLOW_THREADS
  if (!ok) {
    PyErr_SetString(PyExc_RuntimeError, "delta_encode: old or new was modified while being encoded");
    return nullptr;
  }
  if (!with_checksums)
    return Py_BuildValue("(NNNN)", table.release(), gaps.release(), steps.release(), escapes.release());
  const unsigned long long new_sum = wsync::combine_digests(new_digests);
  if (with_checksums == 2)
    return Py_BuildValue("(NNNNOK)", table.release(), gaps.release(), steps.release(), escapes.release(), Py_None,
                         new_sum);
  return Py_BuildValue("(NNNNKK)", table.release(), gaps.release(), steps.release(), escapes.release(),
                       (unsigned long long)wsync::combine_digests(old_digests), new_sum);
}

// ---- decode and apply ---------------------------------------------------------

// The reference's checks on the table, in its order; false with InvalidSections set.
bool check_table(const std::vector<uint32_t>& table, int64_t n, int64_t n_gaps, int64_t n_steps,
                 int64_t n_escapes, int64_t* total, int64_t* total_esc, std::vector<int64_t>& offsets) {
  const int64_t nc = wsync::nchunks(n);
  if (int64_t(table.size()) != 2 * nc) {
    PyErr_Format(InvalidSections, "chunk table has %lld entries, expected %lld", (long long)table.size(),
                 (long long)(2 * nc));
    return false;
  }
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t cnt = table[c], esc = table[nc + c], len = wsync::chunk_len(n, c);
    if (cnt > len || esc > cnt) {
      PyErr_Format(InvalidSections, "chunk %lld: %lld changes, %lld escapes for %lld elements", (long long)c,
                   (long long)cnt, (long long)esc, (long long)len);
      return false;
    }
  }
  offsets.resize(size_t(2 * nc));
  wsync::table_offsets(table.data(), nc, offsets.data(), total, total_esc);
  if (n_gaps != *total || n_steps != *total || n_escapes != *total_esc) {
    PyErr_Format(InvalidSections,
                 "section sizes gaps=%lld steps=%lld escapes=%lld disagree with the chunk table "
                 "(%lld changes, %lld escapes)",
                 (long long)n_gaps, (long long)n_steps, (long long)n_escapes, (long long)*total,
                 (long long)*total_esc);
    return false;
  }
  return true;
}

// The base and sections of a decode or apply call, validated up to what the
// table alone can tell; the per-change checks happen in the kernels.
struct DecodeArgs {
  StreamArg old;
  Buffer tb, gb, sb, eb;
  int width = 0, order = -1;
  int64_t n = 0, total = 0, total_esc = 0;
  std::vector<uint32_t> table;
  std::vector<int64_t> offsets;

  bool parse(PyObject* const objs[5], int width_, const char* order_name, bool writable_old = false) {
    width = width_;
    order = parse_order(order_name);
    if (!check_kind(width, order, order_name) || !old.get(objs[0], writable_old ? "bits" : "old", width, writable_old) ||
        !tb.get(objs[1]) || !gb.get(objs[2]) || !sb.get(objs[3]) || !eb.get(objs[4]))
      return false;
    n = old.size() / width;
    const int64_t n_table = elements(tb, 4, "table"), n_gaps = elements(gb, 2, "gaps");
    const int64_t n_esc = elements(eb, width, "escapes");
    if (n < 0 || n_table < 0 || n_gaps < 0 || n_esc < 0) return false;
    // A private aligned copy (8 bytes per 64K elements): the payload may be misaligned or change meanwhile.
    table.resize(size_t(n_table));
    if (n_table) std::memcpy(table.data(), tb.data(), size_t(4 * n_table));
    return check_table(table, n, n_gaps, sb.size(), n_esc, &total, &total_esc, offsets);
  }
  const int8_t* steps() const { return reinterpret_cast<const int8_t*>(sb.data()); }
};

// Turn a kernel's verdict into InvalidSections with the reference's message; true if all was well.
bool report(const wsync::ChunkCheck& r, int64_t n) {
  if (r.bad_change >= 0) {
    PyErr_Format(InvalidSections, "change #%lld lands at offset %lld of chunk %lld, which has %lld elements",
                 (long long)r.bad_change, (long long)r.bad_offset, (long long)r.chunk,
                 (long long)wsync::chunk_len(n, r.chunk));
    return false;
  }
  if (r.escapes_mismatch) {
    PyErr_SetString(InvalidSections, "escape markers in the steps disagree with the chunk table's escape counts");
    return false;
  }
  return true;
}

PyObject* py_write_changes(PyObject*, PyObject* args) {
  PyObject *dst_obj, *src_obj, *table_obj, *gaps_obj;
  int width;
  if (!PyArg_ParseTuple(args, "OOOOi:write_changes", &dst_obj, &src_obj, &table_obj, &gaps_obj, &width))
    return nullptr;
  if (width != 1 && width != 2 && width != 4 && width != 8) {
    PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, got %d", width);
    return nullptr;
  }
  StreamArg dst, src;
  Buffer tb, gb;
  if (!dst.get(dst_obj, "dst", width, true) || !src.get(src_obj, "src", width) || !tb.get(table_obj) ||
      !gb.get(gaps_obj))
    return nullptr;
  const int64_t n = dst.size() / width, n_table = elements(tb, 4, "table"), n_gaps = elements(gb, 2, "gaps");
  if (n_table < 0 || n_gaps < 0) return nullptr;
  if (src.size() != dst.size()) {
    PyErr_Format(PyExc_ValueError, "dst and src differ in size: %lld vs %lld bytes", (long long)dst.size(),
                 (long long)src.size());
    return nullptr;
  }
  std::vector<uint32_t> table(static_cast<size_t>(n_table));
  if (n_table) std::memcpy(table.data(), tb.data(), size_t(4 * n_table));
  std::vector<int64_t> offsets;
  int64_t total = 0, total_esc = 0;
  // steps and escapes are not read here: hold the table to the gaps alone
  int64_t escapes = 0;
  for (size_t c = table.size() / 2; c < table.size(); ++c) escapes += table[c];
  if (!check_table(table, n, n_gaps, n_gaps, escapes, &total, &total_esc, offsets)) return nullptr;
  wsync::ChunkCheck r;
  Py_BEGIN_ALLOW_THREADS
  by_width(width, [&](auto zero) {
    r = wsync::write_changes<decltype(zero)>(dst.s, src.s, n, table.data(), offsets.data(), gb.data());
  });
  Py_END_ALLOW_THREADS
  if (!report(r, n)) return nullptr;
  Py_RETURN_NONE;
}

PyObject* py_delta_decode(PyObject*, PyObject* args) {
  PyObject* objs[5];
  int width, with_checksum = 0;
  const char* order_name;
  if (!PyArg_ParseTuple(args, "OOOOOis|p:delta_decode", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &width,
                        &order_name, &with_checksum))
    return nullptr;
  DecodeArgs d;
  Owned positions, values;
  if (!d.parse(objs, width, order_name) || !positions.alloc(8 * d.total) || !values.alloc(width * d.total))
    return nullptr;
  std::vector<uint64_t> old_digests(static_cast<size_t>(with_checksum ? wsync::nblocks(d.old.size()) : 0));
  wsync::ChunkCheck r;
  Py_BEGIN_ALLOW_THREADS
  wsync::dispatch(width, d.order, [&](auto zero, auto o) {
    r = wsync::decode_all<decltype(zero), decltype(o)::value>(d.old.s, d.n, d.table.data(), d.offsets.data(),
                                                              d.gb.data(), d.steps(), d.eb.data(), positions.bytes(),
                                                              values.bytes(),
                                                              with_checksum ? old_digests.data() : nullptr);
  });
  Py_END_ALLOW_THREADS
  if (!report(r, d.n)) return nullptr;
  if (!with_checksum) return Py_BuildValue("(NN)", positions.release(), values.release());
  return Py_BuildValue("(NNK)", positions.release(), values.release(),
                       (unsigned long long)wsync::combine_digests(old_digests));
}

PyObject* py_delta_apply(PyObject*, PyObject* args) {
  PyObject *objs[5], *out_obj;
  int width;
  const char* order_name;
  if (!PyArg_ParseTuple(args, "OOOOOisO:delta_apply", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &width,
                        &order_name, &out_obj))
    return nullptr;
  DecodeArgs d;
  StreamArg out;
  if (!d.parse(objs, width, order_name) || !out.get(out_obj, "out", width, true)) return nullptr;
  const bool overlap = out.overlaps(d.old);
  if (out.size() != d.old.size() || overlap) {
    PyErr_Format(PyExc_ValueError, "out must be a separate buffer of %lld bytes, got %lld bytes%s",
                 (long long)d.old.size(), (long long)out.size(), overlap ? " overlapping old" : "");
    return nullptr;
  }
  const int64_t nb = wsync::nblocks(d.old.size());
  std::vector<uint64_t> old_digests(static_cast<size_t>(nb)), new_digests(static_cast<size_t>(nb));
  wsync::ChunkCheck r;
  Py_BEGIN_ALLOW_THREADS
  wsync::dispatch(width, d.order, [&](auto zero, auto o) {
    r = wsync::apply_all<decltype(zero), decltype(o)::value>(
        d.old.s, d.n, d.table.data(), d.offsets.data(), d.gb.data(), d.steps(), d.eb.data(), out.s,
        old_digests.data(), new_digests.data());
  });
  Py_END_ALLOW_THREADS
  if (!report(r, d.n)) return nullptr;
  return Py_BuildValue("(KK)", (unsigned long long)wsync::combine_digests(old_digests),
                       (unsigned long long)wsync::combine_digests(new_digests));
}

PyObject* py_delta_apply_inplace(PyObject*, PyObject* args) {
  PyObject* objs[5];
  int width;
  const char* order_name;
  if (!PyArg_ParseTuple(args, "OOOOOis:delta_apply_inplace", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                        &width, &order_name))
    return nullptr;
  DecodeArgs d;
  Owned positions, saved;
  if (!d.parse(objs, width, order_name, true) || !positions.alloc(8 * d.total) || !saved.alloc(width * d.total))
    return nullptr;
  const wsync::Stream& bits = d.old.s;
  const int64_t nb = wsync::nblocks(d.old.size()), nc = wsync::nchunks(d.n);
  std::vector<uint64_t> old_digests(static_cast<size_t>(nb)), new_digests(static_cast<size_t>(nb));
  std::vector<int64_t> written(static_cast<size_t>(nc), 0);
  wsync::ChunkCheck r;
  Py_BEGIN_ALLOW_THREADS
  wsync::dispatch(width, d.order, [&](auto zero, auto o) {
    r = wsync::apply_inplace_all<decltype(zero), decltype(o)::value>(
        bits, d.n, d.table.data(), d.offsets.data(), d.gb.data(), d.steps(), d.eb.data(), positions.bytes(),
        saved.bytes(), written.data(), old_digests.data(), new_digests.data());
    // Bad sections: the base goes back to exactly what it was before this call.
    if (r.bad_change >= 0 || r.escapes_mismatch)
      wsync::restore_written<decltype(zero)>(bits, nc, d.offsets.data(), written.data(), positions.bytes(),
                                             saved.bytes());
  });
  Py_END_ALLOW_THREADS
  if (!report(r, d.n)) return nullptr;
  return Py_BuildValue("(NNKK)", positions.release(), saved.release(),
                       (unsigned long long)wsync::combine_digests(old_digests),
                       (unsigned long long)wsync::combine_digests(new_digests));
}

PyObject* py_copy_checksum(PyObject*, PyObject* args) {
  PyObject *src_obj, *dst_obj;
  if (!PyArg_ParseTuple(args, "OO:copy_checksum", &src_obj, &dst_obj)) return nullptr;
  StreamArg src, dst;
  if (!src.get(src_obj, "src", 0) || !dst.get(dst_obj, "dst", 0, true)) return nullptr;
  const bool overlap = dst.overlaps(src);
  if (dst.size() != src.size() || overlap) {
    PyErr_Format(PyExc_ValueError, "dst must be a separate buffer of %lld bytes, got %lld bytes%s",
                 (long long)src.size(), (long long)dst.size(), overlap ? " overlapping src" : "");
    return nullptr;
  }
  uint64_t h;
  Py_BEGIN_ALLOW_THREADS
  h = wsync::copy_tree_checksum(src.s, dst.s);
  Py_END_ALLOW_THREADS
  return PyLong_FromUnsignedLongLong(h);
}

PyObject* py_put(PyObject*, PyObject* args) {
  PyObject *bits_obj, *pos_obj, *val_obj;
  int width;
  if (!PyArg_ParseTuple(args, "OOOi:put", &bits_obj, &pos_obj, &val_obj, &width)) return nullptr;
  if (width != 1 && width != 2 && width != 4 && width != 8) {
    PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, got %d", width);
    return nullptr;
  }
  StreamArg bits;
  Buffer pb, vb;
  if (!bits.get(bits_obj, "bits", width, true) || !pb.get(pos_obj) || !vb.get(val_obj)) return nullptr;
  const int64_t count = elements(pb, 8, "positions");
  if (count < 0) return nullptr;
  if (vb.size() != count * width) {
    PyErr_Format(PyExc_ValueError, "values: %lld bytes for %lld positions of %d-byte elements", (long long)vb.size(),
                 (long long)count, width);
    return nullptr;
  }
  const int64_t n = bits.size() / width;
  // A private copy of the positions, checked whole before anything is written.
  std::vector<int64_t> pos(static_cast<size_t>(count));
  if (count) std::memcpy(pos.data(), pb.data(), size_t(8 * count));
  for (int64_t k = 0; k < count; ++k)
    if (pos[k] < 0 || pos[k] >= n) {
      PyErr_Format(PyExc_ValueError, "positions[%lld] = %lld is outside [0, %lld)", (long long)k, (long long)pos[k],
                   (long long)n);
      return nullptr;
    }
  Py_BEGIN_ALLOW_THREADS
  by_width(width, [&](auto zero) {
    wsync::put_values<decltype(zero)>(bits.s, reinterpret_cast<const uint8_t*>(pos.data()), vb.data(), count);
  });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// Y [m, k] fp32 = (w_new - w_old) @ omega, from bf16 patterns w_* [m, n] and fp32 omega [n, k], rows in parallel
// (wsync.lowrank's range finder; the twin of lora_range_bf16 in csrc/delta_cuda.cu).
PyObject* py_lora_range(PyObject*, PyObject* args) {
  PyObject *a_obj, *b_obj, *om_obj, *y_obj;
  long long m, n, k;
  if (!PyArg_ParseTuple(args, "OOOOLLL:lora_range", &a_obj, &b_obj, &om_obj, &y_obj, &m, &n, &k)) return nullptr;
  Buffer a, b, om, y;
  if (!a.get(a_obj) || !b.get(b_obj) || !om.get(om_obj) || !y.get(y_obj, true)) return nullptr;
  if (m < 0 || n < 0 || k < 0 || a.size() != 2 * m * n || b.size() != 2 * m * n || om.size() != 4 * n * k ||
      y.size() != 4 * m * k) {
    PyErr_Format(PyExc_ValueError, "lora_range: buffers of %lld, %lld, %lld, %lld bytes for m=%lld n=%lld k=%lld",
                 (long long)a.size(), (long long)b.size(), (long long)om.size(), (long long)y.size(), m, n, k);
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  const auto* pa = reinterpret_cast<const ws::u16*>(a.data());
  const auto* pb = reinterpret_cast<const ws::u16*>(b.data());
  const auto* po = reinterpret_cast<const float*>(om.data());
  auto* py = reinterpret_cast<float*>(y.writable_data());
  wsync::parallel_for(m, 1, [&](int64_t r) {
    ws::lora_range_row_host(pa + r * n, pb + r * n, po, ws::u64(n), ws::u32(k), py + r * k);
  });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// ---- quantizers (wsync.quant; csrc/ws_quant.cuh, shared with the CUDA kernels) -------------------------------

// Call f(std::integral_constant<int, D>) for a weight dtype number of ws_quant.cuh; false (ValueError) for others.
template <class F>
bool by_qdtype(int dtype, F&& f) {
  switch (dtype) {
    case ws::QD_BF16: f(std::integral_constant<int, ws::QD_BF16>{}); return true;
    case ws::QD_F16: f(std::integral_constant<int, ws::QD_F16>{}); return true;
    case ws::QD_F32: f(std::integral_constant<int, ws::QD_F32>{}); return true;
    default:
      PyErr_Format(PyExc_ValueError, "quantize: weight dtype number must be 0 (BF16), 1 (F16) or 2 (F32), got %d", dtype);
      return false;
  }
}

int qdtype_width(int dtype) { return dtype == ws::QD_F32 ? 4 : 2; }

// The quantizers' loops over elements are compute-bound at SSE2's four floats, so on x86-64 each row / block
// function is built a second time for AVX2 (eight), with everything it calls inlined into it (ws_quant.cuh's
// helpers are always-inline), and picked at run time on CPUs that have AVX2 ($WSYNC_NO_AVX2 turns it off, as
// for xxh3). No FMA: the target adds none, so nothing is contracted and the bytes are the baseline's.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define WS_QUANT_AVX2 __attribute__((target("avx2")))
bool quant_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && !std::getenv("WSYNC_NO_AVX2");
  return yes;
}
#else
#define WS_QUANT_AVX2
bool quant_avx2() { return false; }
#endif

template <int D, bool AVX2> struct QuantRows;

template <int D> struct QuantRows<D, false> {
  typedef typename ws::QType<D>::T T;
  static ws::i64 int4(const T* x, ws::u64 k, ws::u32 group, ws::u32* packed, T* scale, ws::i8* tmp,
                                    ws::u32* amax) {
    return group == 32 ? ws::q_int4_row_host<D, 32>(x, k, group, packed, scale, tmp, amax)
                       : ws::q_int4_row_host<D, 0>(x, k, group, packed, scale, tmp, amax);
  }
  static ws::i64 int8(const T* x, ws::u64 k, ws::i8* codes, T* scale) { return ws::q_int8_row_host<D>(x, k, codes, scale); }
  static ws::i64 fp8(const T* x, ws::u64 n, ws::u64 h, ws::u64 w, ws::u8* codes, float* sf) {
    return ws::q_fp8_block_host<D>(x, n, h, w, codes, sf);
  }
};

template <int D> struct QuantRows<D, true> {
  typedef typename ws::QType<D>::T T;
  WS_QUANT_AVX2 static ws::i64 int4(const T* x, ws::u64 k, ws::u32 group, ws::u32* packed, T* scale, ws::i8* tmp,
                                    ws::u32* amax) {
    return group == 32 ? ws::q_int4_row_host<D, 32>(x, k, group, packed, scale, tmp, amax)
                       : ws::q_int4_row_host<D, 0>(x, k, group, packed, scale, tmp, amax);
  }
  WS_QUANT_AVX2 static ws::i64 int8(const T* x, ws::u64 k, ws::i8* codes, T* scale) {
    return ws::q_int8_row_host<D>(x, k, codes, scale);
  }
  WS_QUANT_AVX2 static ws::i64 fp8(const T* x, ws::u64 n, ws::u64 h, ws::u64 w, ws::u8* codes, float* sf) {
    return ws::q_fp8_block_host<D>(x, n, h, w, codes, sf);
  }
};

// Call f(std::integral_constant<int, D>, std::bool_constant<AVX2>) for the dtype and this CPU.
template <class F>
bool by_qdtype_isa(int dtype, F&& f) {
  const bool avx2 = quant_avx2();
  return by_qdtype(dtype, [&](auto d) {
    if (avx2)
      f(d, std::true_type{});
    else
      f(d, std::false_type{});
  });
}

// The smallest flat index any unit reported (units run on several threads; the least wins, as the reference's).
struct FirstBad {
  std::atomic<int64_t> at{INT64_MAX};
  void offer(int64_t i) {
    int64_t cur = at.load();
    while (i < cur && !at.compare_exchange_weak(cur, i)) {
    }
  }
  long long result() const { return at.load() == INT64_MAX ? -1 : (long long)at.load(); }
};

bool check_sizes(const char* what, std::initializer_list<std::pair<const Buffer*, int64_t>> want) {
  for (const auto& [b, bytes] : want)
    if (b->size() != bytes) {
      PyErr_Format(PyExc_ValueError, "%s: a buffer of %lld bytes where the shape needs %lld", what,
                   (long long)b->size(), (long long)bytes);
      return false;
    }
  return true;
}

// Row units per claim: about 64K elements, so a short row does not cost a claim each.
int64_t row_grain(int64_t k) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, k)); }

PyObject* py_quantize_int4(PyObject*, PyObject* args) {
  PyObject *x_obj, *p_obj, *s_obj;
  int dtype;
  long long rows, k, group;
  if (!PyArg_ParseTuple(args, "OiLLLOO:quantize_int4", &x_obj, &dtype, &rows, &k, &group, &p_obj, &s_obj))
    return nullptr;
  Buffer x, packed, scale;
  if (!x.get(x_obj) || !packed.get(p_obj, true) || !scale.get(s_obj, true)) return nullptr;
  if (rows < 0 || k < 0 || group <= 0 || group % 8 || k % group) {
    PyErr_Format(PyExc_ValueError, "quantize_int4: rows=%lld k=%lld group=%lld (k a multiple of group, group of 8)",
                 rows, k, group);
    return nullptr;
  }
  const int w = qdtype_width(dtype);
  if (!check_sizes("quantize_int4", {{&x, rows * k * w}, {&packed, rows * (k / 8) * 4}, {&scale, rows * (k / group) * w}}))
    return nullptr;
  FirstBad bad;
  const bool ok = by_qdtype_isa(dtype, [&](auto d, auto isa) {
    constexpr int D = decltype(d)::value;
    typedef typename ws::QType<D>::T T;
    typedef QuantRows<D, decltype(isa)::value> Rows;
    const T* px = reinterpret_cast<const T*>(x.data());
    auto* pp = reinterpret_cast<ws::u32*>(packed.writable_data());
    T* ps = reinterpret_cast<T*>(scale.writable_data());
    Py_BEGIN_ALLOW_THREADS
    wsync::parallel_for(rows, row_grain(k), [&](int64_t r) {
      thread_local std::vector<ws::i8> tmp;
      thread_local std::vector<ws::u32> amax;
      if (tmp.size() < size_t(k)) tmp.resize(size_t(k));
      if (amax.size() < size_t(k / group)) amax.resize(size_t(k / group));
      const ws::i64 j = Rows::int4(px + r * k, ws::u64(k), ws::u32(group), pp + r * (k / 8), ps + r * (k / group),
                                   tmp.data(), amax.data());
      if (j >= 0) bad.offer(r * k + j);
    });
    Py_END_ALLOW_THREADS
  });
  if (!ok) return nullptr;
  return PyLong_FromLongLong(bad.result());
}

PyObject* py_quantize_int8(PyObject*, PyObject* args) {
  PyObject *x_obj, *c_obj, *s_obj;
  int dtype;
  long long rows, k;
  if (!PyArg_ParseTuple(args, "OiLLOO:quantize_int8", &x_obj, &dtype, &rows, &k, &c_obj, &s_obj)) return nullptr;
  Buffer x, codes, scale;
  if (!x.get(x_obj) || !codes.get(c_obj, true) || !scale.get(s_obj, true)) return nullptr;
  if (rows < 0 || k < 0) {
    PyErr_Format(PyExc_ValueError, "quantize_int8: rows=%lld k=%lld", rows, k);
    return nullptr;
  }
  const int w = qdtype_width(dtype);
  if (!check_sizes("quantize_int8", {{&x, rows * k * w}, {&codes, rows * k}, {&scale, rows * w}})) return nullptr;
  FirstBad bad;
  const bool ok = by_qdtype_isa(dtype, [&](auto d, auto isa) {
    constexpr int D = decltype(d)::value;
    typedef typename ws::QType<D>::T T;
    typedef QuantRows<D, decltype(isa)::value> Rows;
    const T* px = reinterpret_cast<const T*>(x.data());
    auto* pc = reinterpret_cast<ws::i8*>(codes.writable_data());
    T* ps = reinterpret_cast<T*>(scale.writable_data());
    Py_BEGIN_ALLOW_THREADS
    wsync::parallel_for(rows, row_grain(k), [&](int64_t r) {
      const ws::i64 j = Rows::int8(px + r * k, ws::u64(k), pc + r * k, ps + r);
      if (j >= 0) bad.offer(r * k + j);
    });
    Py_END_ALLOW_THREADS
  });
  if (!ok) return nullptr;
  return PyLong_FromLongLong(bad.result());
}

PyObject* py_quantize_fp8(PyObject*, PyObject* args) {
  PyObject *x_obj, *c_obj, *s_obj;
  int dtype;
  long long mats, m, n, bm, bn;
  if (!PyArg_ParseTuple(args, "OiLLLLLOO:quantize_fp8", &x_obj, &dtype, &mats, &m, &n, &bm, &bn, &c_obj, &s_obj))
    return nullptr;
  Buffer x, codes, sf;
  if (!x.get(x_obj) || !codes.get(c_obj, true) || !sf.get(s_obj, true)) return nullptr;
  if (mats < 0 || m < 0 || n < 0 || bm <= 0 || bn <= 0) {
    PyErr_Format(PyExc_ValueError, "quantize_fp8: matrices=%lld m=%lld n=%lld block=%lldx%lld", mats, m, n, bm, bn);
    return nullptr;
  }
  const int64_t rb = (m + bm - 1) / bm, cb = (n + bn - 1) / bn;
  const int w = qdtype_width(dtype);
  if (!check_sizes("quantize_fp8", {{&x, mats * m * n * w}, {&codes, mats * m * n}, {&sf, mats * rb * cb * 4}}))
    return nullptr;
  FirstBad bad;
  const bool ok = by_qdtype_isa(dtype, [&](auto d, auto isa) {
    constexpr int D = decltype(d)::value;
    typedef typename ws::QType<D>::T T;
    typedef QuantRows<D, decltype(isa)::value> Rows;
    const T* px = reinterpret_cast<const T*>(x.data());
    auto* pc = reinterpret_cast<ws::u8*>(codes.writable_data());
    auto* ps = reinterpret_cast<float*>(sf.writable_data());
    Py_BEGIN_ALLOW_THREADS
    wsync::parallel_for(mats * rb * cb, 1, [&](int64_t b) {
      const int64_t mat = b / (rb * cb), bi = (b / cb) % rb, bj = b % cb;
      const int64_t at = mat * m * n + bi * bm * n + bj * bn;
      const ws::i64 j = Rows::fp8(px + at, ws::u64(n), ws::u64(std::min(bm, m - bi * bm)),
                                  ws::u64(std::min(bn, n - bj * bn)), pc + at, ps + b);
      if (j >= 0) bad.offer(at + j);
    });
    Py_END_ALLOW_THREADS
  });
  if (!ok) return nullptr;
  return PyLong_FromLongLong(bad.result());
}

// ---- module -----------------------------------------------------------------

PyMethodDef methods[] = {
    {"checksum", py_checksum, METH_O,
     "checksum(buf) -> int: the xxh3-64 block tree of wsync.checksum over a C-contiguous buffer."},
    {"delta_encode", py_delta_encode, METH_VARARGS,
     "delta_encode(old, new, width, order, checksums=0) -> (table, gaps, steps, escapes) as bytearrays,\n"
     "plus (old_checksum, new_checksum) computed in the same pass if checksums is 1, (None, new_checksum) if 2."},
    {"write_changes", py_write_changes, METH_VARARGS,
     "write_changes(dst, src, table, gaps, width) -> None: dst[i] = src[i] at every change position the table\n"
     "and gaps give; raises InvalidSections on a position outside its chunk (nothing past it is written)."},
    {"delta_decode", py_delta_decode, METH_VARARGS,
     "delta_decode(old, table, gaps, steps, escapes, width, order, checksum=False) -> (positions, values) as\n"
     "bytearrays, plus old's checksum from the same pass if checksum; raises InvalidSections on sections the\n"
     "reference would reject."},
    {"delta_apply", py_delta_apply, METH_VARARGS,
     "delta_apply(old, table, gaps, steps, escapes, width, order, out) -> (old_checksum, new_checksum):\n"
     "out = old with the changes applied, both checksummed in the same pass; out is garbage on error."},
    {"delta_apply_inplace", py_delta_apply_inplace, METH_VARARGS,
     "delta_apply_inplace(bits, table, gaps, steps, escapes, width, order) -> (positions, saved, old_checksum,\n"
     "new_checksum): the changes written into bits, checksummed before and after in the same pass; positions\n"
     "(int64) and saved (old bits) say what was overwritten. On InvalidSections bits is left as it was."},
    {"copy_checksum", py_copy_checksum, METH_VARARGS,
     "copy_checksum(src, dst) -> int: dst = src (separate buffers of one size) and the checksum, in one pass."},
    {"put", py_put, METH_VARARGS,
     "put(bits, positions, values, width) -> None: bits[positions[k]] = values[k] (int64 positions in any order,\n"
     "each checked to lie in bits before anything is written; ValueError otherwise)."},
    {"lora_range", py_lora_range, METH_VARARGS,
     "lora_range(w_new, w_old, omega, y, m, n, k) -> None: y = (w_new - w_old) @ omega (bf16 patterns, fp32)."},
    {"quantize_int4", py_quantize_int4, METH_VARARGS,
     "quantize_int4(x, dtype, rows, k, group, packed, scale) -> int: compressed-tensors' symmetric INT4 of rows x k\n"
     "weight patterns (dtype 0 BF16, 1 F16, 2 F32), a scale per group, packed 8 to an int32; the flat index of\n"
     "the first non-finite element, or -1."},
    {"quantize_int8", py_quantize_int8, METH_VARARGS,
     "quantize_int8(x, dtype, rows, k, codes, scale) -> int: compressed-tensors' symmetric INT8, a scale per row;\n"
     "the flat index of the first non-finite element, or -1."},
    {"quantize_fp8", py_quantize_fp8, METH_VARARGS,
     "quantize_fp8(x, dtype, matrices, m, n, bm, bn, codes, scale_inv) -> int: vLLM's block FP8 e4m3 cast of\n"
     "matrices x [m, n], a float32 scale per bm x bn block; the flat index of the first non-finite element, or -1."},
    {"v2_encode", ws_v2_py_encode, METH_VARARGS, "delta v2 parts of v1 sections against the base (csrc/ws_v2.h)"},
    {"v2_decode", ws_v2_py_decode, METH_VARARGS, "v1 sections of delta v2 parts against the base, or an error str"},
    {"v2_paths", ws_v2_py_paths, METH_NOARGS, "chunks v2 ran on the bit planes and on the portable code, so far"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "wsync._cpu", "C++ CPU kernels of the wsync delta format.", -1,
                      methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__cpu(void) {
  PyObject* m = PyModule_Create(&module);
  if (!m) return nullptr;
  InvalidSections = PyErr_NewException("wsync._cpu.InvalidSections", PyExc_ValueError, nullptr);
  if (!InvalidSections || PyModule_AddObjectRef(m, "InvalidSections", InvalidSections) < 0 ||
      PyModule_AddIntConstant(m, "max_threads", wsync::default_threads()) < 0 ||
      PyModule_AddIntConstant(m, "chunk_elems", long(wsync::kChunk)) < 0 ||
      PyModule_AddIntConstant(m, "block_bytes", long(wsync::kBlock)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
