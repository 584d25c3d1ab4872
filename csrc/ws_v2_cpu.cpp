// wsync._cpu's delta v2 functions (csrc/ws_v2.h), registered in delta_cpu.cpp's method table.
//
//   v2_encode(old, table, gaps, steps, escapes, width, order, kind, shift, ebits) -> (model, index, pos, steps)
//   v2_decode(old, model, index, pos, steps, width, order, kind, shift, ebits)
//       -> (table, gaps, steps, escapes) as bytearrays, or a str saying what was wrong with the payload
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
  Buf old, table, gaps, steps, esc;
  if (!old.get(o_old) || !table.get(o_table) || !gaps.get(o_gaps) || !steps.get(o_steps) || !esc.get(o_esc))
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
    wsync::v2::encode<T, decltype(o)::value>(reinterpret_cast<const T*>(old.data()), n, t, gaps.data(),
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
  Buf old, model, index, pos, steps;
  if (!old.get(o_old) || !model.get(o_model) || !index.get(o_index) || !pos.get(o_pos) || !steps.get(o_steps))
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
    ok = wsync::v2::decode<T, decltype(o)::value>(reinterpret_cast<const T*>(old.data()), n, model.data(),
                                                  model.size(), index.data(), index.size(), pos.data(), pos.size(),
                                                  steps.data(), steps.size(), cs, out, err);
  });
  Py_END_ALLOW_THREADS
  if (!ok) return PyUnicode_FromString(err.c_str());
  return Py_BuildValue("(NNNN)", bytearray_of(out.table), bytearray_of(out.gaps), bytearray_of(out.steps),
                       bytearray_of(out.escapes));
}
