"""The C++ CPU backend: the delta and checksum hot loops in wsync._cpu, threaded over chunks, and the
quantizers of wsync.quant (csrc/ws_quant.cuh), threaded over rows and blocks.

The extension is optional (setup.py builds it when a compiler is present), so
this module imports it lazily and explains, through BackendUnavailable, why it
is missing. The kernels write bytearrays that are viewed here as numpy arrays
without a copy; they must agree with wsync.codecs.delta_ref byte for byte
(tests/test_backends.py). Payload sections the reference would reject raise
FormatError with the reference's message; the quantizers write wsync.quant.ref's
bytes and refuse what it refuses with its QuantizeError (tests/test_quant_kernels.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..codecs import v2_ref
from ..codecs.delta_ref import DeltaSections
from ..errors import BackendUnavailable, FormatError
from ..tables import Table
from .base import Composed, Overwritten, check_out

# setup.py leaves the compiler's complaint here when the optional build fails.
BUILD_NOTE = Path(__file__).resolve().parent.parent / "_cpu.build-error.txt"
ORDERS = ("float", "int", "uint")


# Every entry point CpuKernels calls: an extension built from older sources lacks some, and is refused whole
# (backends.select then passes over this backend and says why) rather than half used.
SYMBOLS = ("delta_encode", "delta_decode", "delta_apply", "delta_apply_inplace", "write_changes", "copy_checksum",
           "checksum", "put", "v2_encode", "v2_decode", "lora_range", "quantize_int4", "quantize_int8", "quantize_fp8",
           "max_threads", "InvalidSections")
QUANT_DTYPES = {"BF16": 0, "F16": 1, "F32": 2}  # the weight dtypes of the quantizing kernels (ws::QD_*)


def _import_extension():
    try:
        from .. import _cpu
    except ImportError as e:
        reason = BUILD_NOTE.read_text().strip() if BUILD_NOTE.is_file() else str(e)
        raise BackendUnavailable(
            f"C++ extension wsync._cpu is not built: {reason}; reinstall with a C++ compiler present"
        ) from e
    return _cpu


def check_extension(ext):
    """ext, once it has every entry point this backend calls; BackendUnavailable naming what it lacks."""
    missing = [name for name in SYMBOLS if not hasattr(ext, name)]
    if missing:
        where = getattr(ext, "__file__", None) or getattr(ext, "__name__", "the extension")
        raise BackendUnavailable(f"C++ extension {where} lacks {', '.join(missing)}: it was built from older "
                                 "sources; rebuild it (pip install -e . with a C++ compiler present)")
    return ext


def _bits(a, what: str):
    """A 1-D C-contiguous unsigned little-endian view, as the kernels expect, or a Table of such pieces."""
    if isinstance(a, Table):
        if a.dtype.kind != "u" or a.dtype.byteorder == ">":
            raise TypeError(f"{what} must be a table of little-endian unsigned bit patterns, got {a.dtype}")
        return a
    if not isinstance(a, np.ndarray) or a.dtype.kind != "u" or a.dtype.byteorder == ">":
        raise TypeError(f"{what} must be a numpy array of little-endian unsigned bit patterns, got {getattr(a, 'dtype', type(a))}")
    return np.ascontiguousarray(a).reshape(-1)


def _writable(a, what: str):
    """_bits of an array or Table the kernels will write into (never a copy)."""
    if isinstance(a, Table):
        if not a.writable:
            raise TypeError(f"{what}: this table's pieces are read-only")
        return _bits(a, what)
    if not isinstance(a, np.ndarray) or a.ndim != 1 or not a.flags.c_contiguous or not a.flags.writeable:
        raise TypeError(f"{what} must be a writable 1-D C-contiguous array of bit patterns")
    return _bits(a, what)


def _arg(a):
    """What the extension takes: a buffer, or a Table's (addrs, starts)."""
    return a.arg() if isinstance(a, Table) else a


def _check_same(a, b, what: str) -> None:
    """The checks of base.check_out for arrays or Tables (a Table's pieces are trusted not to overlap)."""
    if isinstance(a, Table) or isinstance(b, Table):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(f"{what} must be {a.dtype}{list(a.shape)}, got {b.dtype}{list(b.shape)}")
        return
    check_out(a, b, overlap=what == "dst")


def _section(a: np.ndarray, dtype, what: str) -> np.ndarray:
    """A section in the dtype the format fixes; anything else is the caller's bug, not bad bytes."""
    if not isinstance(a, np.ndarray) or a.dtype != np.dtype(dtype):
        raise TypeError(f"{what} must be a numpy array of {np.dtype(dtype)}, got {getattr(a, 'dtype', type(a))}")
    return np.ascontiguousarray(a)


def quant_dims(scheme, shape: tuple[int, ...], dtype: str) -> tuple[int, ...] | None:
    """How the quantizing kernels (csrc/ws_quant.cuh) see a weight of this shape: (rows, k, group) for
    int4_group, (rows, k) for int8_channel, (matrices, m, n, bm, bn) for fp8_block; None where the kernels have
    nothing to do and the reference must answer (a dtype or shape it refuses with its own message, or no
    elements)."""
    shape = tuple(int(d) for d in shape)
    if dtype not in QUANT_DTYPES or not shape or 0 in shape:
        return None
    lead = int(np.prod(shape[:-1], dtype=np.int64))
    if scheme.kind == "int4_group":
        group = int(scheme.group)
        return None if group <= 0 or group % 8 or shape[-1] % group else (lead, shape[-1], group)
    if len(shape) < 2:
        return None
    if scheme.kind == "int8_channel":
        return (lead, shape[-1])
    if scheme.kind == "fp8_block":
        *mats, m, n = shape
        return (int(np.prod(mats, dtype=np.int64)), m, n, *(int(b) for b in scheme.block))
    return None


def quant_refuse(scheme, bits: np.ndarray, dtype: str, at: int, what: str):
    """The reference's QuantizeError for a weight whose element `at` (flat) a kernel found not finite: the
    scheme's reference refuses it before any arithmetic, with the message every backend gives."""
    scheme.reference(bits, dtype, what)
    raise AssertionError(f"{what}: the quantizing kernel reported element {at} not finite; the reference finds none")


def _order(order: str) -> str:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return order


class CpuKernels(Composed):
    name = "cpu"

    def __init__(self):
        self._cpu = check_extension(_import_extension())
        # For wsync.backend() reports and benchmark records ($WSYNC_THREADS, else $OMP_NUM_THREADS, else CPUs).
        self.threads = self._cpu.max_threads

    def delta_encode(self, old: np.ndarray, new: np.ndarray, order: str) -> DeltaSections:
        return self._encode(old, new, order, False)[0]

    def v2_encode(self, old: np.ndarray, sec: DeltaSections, dtype) -> dict:
        """codecs/v2_ref.encode in C++ (csrc/ws_v2.h): the same bytes."""
        old = _bits(old, "old")
        got = self._cpu.v2_encode(_arg(old), _section(sec.table, "<u4", "table"), _section(sec.gaps, "<u2", "gaps"),
                                  _section(sec.steps, np.int8, "steps"), _section(sec.escapes, old.dtype, "escapes"),
                                  old.dtype.itemsize, _order(dtype.order), *v2_ref.class_spec(dtype))
        return dict(zip(v2_ref.PARTS, got))

    def v2_decode(self, old: np.ndarray, parts: dict, dtype) -> DeltaSections:
        """codecs/v2_ref.decode in C++; a payload it refuses raises FormatError."""
        old = _bits(old, "old")
        got = self._cpu.v2_decode(_arg(old), *(parts[p] for p in v2_ref.PARTS), old.dtype.itemsize, _order(dtype.order),
                                  *v2_ref.class_spec(dtype))
        if isinstance(got, str):
            raise FormatError(got)
        table, gaps, steps, esc = got
        return DeltaSections(np.frombuffer(table, "<u4"), np.frombuffer(gaps, "<u2"), np.frombuffer(steps, np.int8),
                             np.frombuffer(esc, old.dtype))

    def delta_decode(self, old, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray]:
        old = _bits(old, "old")
        pos, values = self._call(self._cpu.delta_decode, old, sec, order)
        return np.frombuffer(pos, np.int64), np.frombuffer(values, old.dtype)

    def checksum(self, buf) -> str:
        return f"{self._cpu.checksum(_arg(buf)):016x}"

    def lowrank_range(self, w_new, w_old, omega):
        """(w_new - w_old) @ omega for two bf16 CPU tensors [m, n] and fp32 omega [n, K], without forming the
        difference (wsync.lowrank's range finder; the C++ twin of the CUDA kernel, csrc/ws_lora.cuh)."""
        import torch

        if w_new.dtype != torch.bfloat16 or w_old.dtype != torch.bfloat16 or w_new.shape != w_old.shape \
                or w_new.dim() != 2 or omega.dtype != torch.float32 or omega.shape[0] != w_new.shape[1]:
            raise TypeError(f"lowrank_range takes two bf16 [m, n] and an fp32 [n, K]; got {w_new.dtype} "
                            f"{tuple(w_new.shape)}, {w_old.dtype} {tuple(w_old.shape)}, {omega.dtype} {tuple(omega.shape)}")
        (m, n), k = w_new.shape, omega.shape[1]
        a = w_new.detach().contiguous().view(torch.int16).numpy()
        b = w_old.detach().contiguous().view(torch.int16).numpy()
        om = omega.detach().contiguous().numpy()
        y = np.empty((m, k), dtype=np.float32)
        self._cpu.lora_range(a, b, om, y, m, n, k)
        return torch.from_numpy(y)

    def quantize(self, scheme, bits, dtype, outs, what="tensor"):
        """scheme.reference(bits, dtype) written into outs, in C++ (csrc/ws_quant.cuh), threaded over rows or
        blocks; what the kernels do not take (a shape or dtype the reference refuses, an empty weight) is the
        reference's."""
        dims = quant_dims(scheme, bits.shape, dtype)
        if dims is None or not isinstance(bits, np.ndarray) or bits.dtype.itemsize != (4 if dtype == "F32" else 2):
            return super().quantize(scheme, bits, dtype, outs, what)
        x = np.ascontiguousarray(bits)
        direct = all(isinstance(o, np.ndarray) and o.flags.c_contiguous and o.flags.writeable for o in outs)
        dst = outs if direct else [np.empty(o.shape, o.dtype) for o in outs]
        code = QUANT_DTYPES[dtype]
        if scheme.kind == "int4_group":
            rows, k, group = dims
            bad = self._cpu.quantize_int4(x, code, rows, k, group, dst[0], dst[1])
            dst[2].reshape(-1).view(np.int64)[:] = bits.shape
        elif scheme.kind == "int8_channel":
            bad = self._cpu.quantize_int8(x, code, *dims, dst[0], dst[1])
        else:
            bad = self._cpu.quantize_fp8(x, code, *dims, dst[0], dst[1])
        if bad >= 0:
            quant_refuse(scheme, x, dtype, bad, what)
        if not direct:
            for o, d in zip(outs, dst):
                np.copyto(o, d)

    # The fused operations of the Kernels protocol, each one pass over the
    # tensor where Composed's take two or three (benchmarks/wsync_bench/kernels.py
    # measures what that is worth end to end).

    def delta_encode_checksummed(self, old: np.ndarray, new: np.ndarray, order: str,
                                 old_sum: bool = True) -> tuple[DeltaSections, str | None, str]:
        sec, sums = self._encode(old, new, order, 1 if old_sum else 2)
        return sec, *sums

    def write_changes(self, dst, src, sec: DeltaSections) -> None:
        if isinstance(dst, Table):
            _writable(dst, "dst")
        elif not isinstance(dst, np.ndarray) or dst.ndim != 1 or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise TypeError("write_changes needs a writable 1-D C-contiguous dst")
        src = _bits(src, "src")
        _check_same(src, dst, "dst")
        try:
            self._cpu.write_changes(_arg(dst), _arg(src), _section(sec.table, "<u4", "table"),
                                    _section(sec.gaps, "<u2", "gaps"), dst.dtype.itemsize)
        except self._cpu.InvalidSections as e:
            raise FormatError(str(e)) from None

    def delta_decode_checksummed(self, old, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray, str]:
        old = _bits(old, "old")
        pos, values, old_sum = self._call(self._cpu.delta_decode, old, sec, order, True)
        return np.frombuffer(pos, np.int64), np.frombuffer(values, old.dtype), f"{old_sum:016x}"

    def delta_apply(self, old, sec: DeltaSections, order: str, out=None) -> tuple[np.ndarray, str, str]:
        """out: an array or a writable Table (old's dtype and size); a fresh array if None."""
        old = _bits(old, "old")
        if out is None:
            out = np.empty(old.size, old.dtype)
        if isinstance(out, Table):
            _writable(out, "out")
        _check_same(old, out, "out")
        sums = self._call(self._cpu.delta_apply, old, sec, order, _arg(out))
        return out, *(f"{s:016x}" for s in sums)

    def delta_apply_inplace(self, bits, sec: DeltaSections, order: str) -> tuple[Overwritten, str, str]:
        bits = _writable(bits, "delta_apply_inplace: bits")
        pos, saved, before, after = self._call(self._cpu.delta_apply_inplace, bits, sec, order)
        return Overwritten(np.frombuffer(saved, bits.dtype), np.frombuffer(pos, np.int64)), f"{before:016x}", f"{after:016x}"

    def copy_checksummed(self, src, dst) -> str:
        if isinstance(dst, Table):
            _writable(dst, "dst")
        return f"{self._cpu.copy_checksum(_arg(src), _arg(dst)):016x}"

    def put(self, bits, positions: np.ndarray, values: np.ndarray) -> None:
        """bits[positions] = values (int64 positions, any order; ValueError, nothing written, if one is outside)."""
        bits = _writable(bits, "put: bits")
        positions = _section(np.asarray(positions), np.int64, "positions")
        values = np.ascontiguousarray(values)
        if values.dtype.itemsize != bits.dtype.itemsize or values.shape != positions.shape:
            raise ValueError(f"values must be {len(positions)} x {bits.dtype}, got {values.dtype}{list(values.shape)}")
        self._cpu.put(_arg(bits), positions, values, bits.dtype.itemsize)

    def _encode(self, old, new, order, checksums: int) -> tuple[DeltaSections, tuple]:
        """checksums: 0 none, 1 old's and new's, 2 new's only (old's is None)."""
        old, new = _bits(old, "old"), _bits(new, "new")
        if old.dtype != new.dtype or old.shape != new.shape:
            raise ValueError(f"old and new differ: {old.dtype}{list(old.shape)} vs {new.dtype}{list(new.shape)}")
        table, gaps, steps, esc, *sums = self._cpu.delta_encode(_arg(old), _arg(new), new.dtype.itemsize, _order(order),
                                                                checksums)
        sec = DeltaSections(
            table=np.frombuffer(table, "<u4"),
            gaps=np.frombuffer(gaps, "<u2"),
            steps=np.frombuffer(steps, np.int8),
            escapes=np.frombuffer(esc, new.dtype.newbyteorder("<")),
        )
        return sec, tuple(None if s is None else f"{s:016x}" for s in sums)

    def _call(self, fn, old, sec: DeltaSections, order: str, *out):
        """Run a decoding kernel on checked sections; bad payload bytes become FormatError."""
        args = (
            _section(sec.table, "<u4", "table"),
            _section(sec.gaps, "<u2", "gaps"),
            _section(sec.steps, np.int8, "steps"),
            _section(sec.escapes, old.dtype, "escapes"),
        )
        try:
            return fn(_arg(old), *args, old.dtype.itemsize, _order(order), *out)
        except self._cpu.InvalidSections as e:
            raise FormatError(str(e)) from None
