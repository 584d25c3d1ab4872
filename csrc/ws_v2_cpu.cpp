// wsync._cpu's delta v2 functions (csrc/ws_v2.h), registered in delta_cpu.cpp's method table.
//
//   v2_encode(old, table, gaps, steps, escapes, width, order, kind, shift, ebits) -> (model, index, pos, steps)
//   v2_decode(old, model, index, pos, steps, width, order, kind, shift, ebits)
//       -> (table, gaps, steps, escapes) as bytearrays, or a str saying what was wrong with the payload
//   v2_paths() -> (planes, portable): chunks encoded or decoded on ws_v2_planes.h and on the portable code
//       since the module loaded (the tests check which path their data took)
//
// kind/shift/ebits say how a value's class is taken (ws::v2::value_class); wsync/backends/cpu.py
// derives them from the dtype. The kernels run with the GIL released.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <string>

#include "ws_v2.h"

namespace {

struct Buf {
  Py_buffer view{};
  bool held = false;
  ~Buf() {
    if (held) PyBuffer_Release(&view);
  }
  bool get(PyObject* obj) {
    held = PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) == 0;
    return held;
  }
  const uint8_t* data() const { return static_cast<const uint8_t*>(view.buf); }
  int64_t size() const { return int64_t(view.len); }
};

// The base: a buffer, or a multi-tensor segment's (addrs, starts) int64 table of pieces (wsync/tables.py).
// Its pieces' addresses come from wsync's own code and are trusted, as delta_cpu.cpp's StreamArg does.
struct Base {
  Buf buf, addrs, starts;
  int64_t one_addr = 0, one_starts[2] = {0, 0};
  wsync::Stream s;
  bool get(PyObject* obj, int width) {
    if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) == 2) {
      if (!addrs.get(PyTuple_GET_ITEM(obj, 0)) || !starts.get(PyTuple_GET_ITEM(obj, 1))) return false;
      const int64_t np = addrs.size() / 8;
      const int64_t* st = reinterpret_cast<const int64_t*>(starts.data());
      bool ok = addrs.size() % 8 == 0 && starts.size() == 8 * (np + 1) && st[0] == 0;
      for (int64_t i = 0; ok && i < np; ++i) ok = st[i + 1] >= st[i] && (st[i + 1] - st[i]) % width == 0;
      if (!ok) {
        PyErr_SetString(PyExc_ValueError, "v2: bad piece table for the base");
        return false;
      }
      s.addrs = reinterpret_cast<const int64_t*>(addrs.data());
      s.starts = st;
      s.n = np;
      return true;
    }
    if (!buf.get(obj)) return false;
    one_addr = int64_t(reinterpret_cast<uintptr_t>(buf.view.buf));
    one_starts[1] = buf.size();
    s.addrs = &one_addr;
    s.starts = one_starts;
    s.n = 1;
    return true;
  }
  int64_t size() const { return s.bytes(); }
};

int order_of(const char* s) {
  if (!std::strcmp(s, "float")) return wsync::kFloat;
  if (!std::strcmp(s, "int")) return wsync::kInt;
  if (!std::strcmp(s, "uint")) return wsync::kUint;
  return -1;
}

bool check(int width, int order, int kind, int shift, int ebits, int64_t old_bytes) {
  if ((width != 1 && width != 2 && width != 4 && width != 8) || order < 0 || kind < 0 || kind > 2 || shift < 0 ||
      ebits < 0 || shift + ebits >= 8 * width || (kind == 0 && ebits == 0) || old_bytes % width) {
    PyErr_SetString(PyExc_ValueError, "v2: bad width, order, class spec or base size");
    return false;
  }
  return true;
}

PyObject* bytes_of(const std::vector<uint8_t>& v) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()), Py_ssize_t(v.size()));
}

template <class V>
PyObject* bytearray_of(const V& v) {
  return PyByteArray_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                       Py_ssize_t(v.size() * sizeof(typename V::value_type)));
}

}  // namespace

PyObject* ws_v2_py_encode(PyObject*, PyObject* args) {
  PyObject *o_old, *o_table, *o_gaps, *o_steps, *o_esc;
  int width, kind, shift, ebits;
  const char* order_name;
  if (!PyArg_ParseTuple(args, "OOOOOisiii:v2_encode", &o_old, &o_table, &o_gaps, &o_steps, &o_esc, &width,
                        &order_name, &kind, &shift, &ebits))
    return nullptr;
  Base old;
  Buf table, gaps, steps, esc;
  if (!old.get(o_old, width > 0 ? width : 1) || !table.get(o_table) || !gaps.get(o_gaps) || !steps.get(o_steps) || !esc.get(o_esc))
    return nullptr;
  const int order = order_of(order_name);
  if (!check(width, order, kind, shift, ebits, old.size())) return nullptr;
  const int64_t n = old.size() / width, nc = wsync::nchunks(n);
  // the sections are our own encoder's, but a wrong caller must not make us read past them
  if (table.size() != 8 * nc) {
    PyErr_SetString(PyExc_ValueError, "v2_encode: table size does not match the base");
    return nullptr;
  }
  const uint32_t* t = reinterpret_cast<const uint32_t*>(table.data());
  int64_t total = 0, total_esc = 0;
  for (int64_t c = 0; c < nc; ++c) {
    if (t[c] > uint32_t(wsync::chunk_len(n, c)) || t[nc + c] > t[c]) {
      PyErr_SetString(PyExc_ValueError, "v2_encode: chunk table out of range");
      return nullptr;
    }
    total += t[c];
    total_esc += t[nc + c];
  }
  if (gaps.size() != 2 * total || steps.size() != total || esc.size() != width * total_esc) {
    PyErr_SetString(PyExc_ValueError, "v2_encode: section sizes disagree with the table");
    return nullptr;
  }
  wsync::v2::Parts parts;
  const wsync::v2::ClassSpec cs{kind, shift, ebits};
  Py_BEGIN_ALLOW_THREADS
  wsync::dispatch(width, order, [&](auto zero, auto o) {
    using T = decltype(zero);
    wsync::v2::encode<T, decltype(o)::value>(old.s, n, t, gaps.data(),
                                             reinterpret_cast<const int8_t*>(steps.data()), esc.data(), cs, parts);
  });
  Py_END_ALLOW_THREADS
  return Py_BuildValue("(NNNN)", bytes_of(parts.model), bytes_of(parts.index), bytes_of(parts.pos),
                       bytes_of(parts.steps));
}

PyObject* ws_v2_py_decode(PyObject*, PyObject* args) {
  PyObject *o_old, *o_model, *o_index, *o_pos, *o_steps;
  int width, kind, shift, ebits;
  const char* order_name;
  if (!PyArg_ParseTuple(args, "OOOOOisiii:v2_decode", &o_old, &o_model, &o_index, &o_pos, &o_steps, &width,
                        &order_name, &kind, &shift, &ebits))
    return nullptr;
  Base old;
  Buf model, index, pos, steps;
  if (!old.get(o_old, width > 0 ? width : 1) || !model.get(o_model) || !index.get(o_index) || !pos.get(o_pos) || !steps.get(o_steps))
    return nullptr;
  const int order = order_of(order_name);
  if (!check(width, order, kind, shift, ebits, old.size())) return nullptr;
  const int64_t n = old.size() / width;
  wsync::v2::Decoded out;
  std::string err;
  bool ok = false;
  const wsync::v2::ClassSpec cs{kind, shift, ebits};
  Py_BEGIN_ALLOW_THREADS
  wsync::dispatch(width, order, [&](auto zero, auto o) {
    using T = decltype(zero);
    ok = wsync::v2::decode<T, decltype(o)::value>(old.s, n, model.data(),
                                                  model.size(), index.data(), index.size(), pos.data(), pos.size(),
                                                  steps.data(), steps.size(), cs, out, err);
  });
  Py_END_ALLOW_THREADS
  if (!ok) return PyUnicode_FromString(err.c_str());
  return Py_BuildValue("(NNNN)", bytearray_of(out.table), bytearray_of(out.gaps), bytearray_of(out.steps),
                       bytearray_of(out.escapes));
}

PyObject* ws_v2_py_paths(PyObject*, PyObject*) {
  return Py_BuildValue("(KK)", (unsigned long long)wsync::v2::path_count(true).load(),
                       (unsigned long long)wsync::v2::path_count(false).load());
}
