"""The C++ CPU backend: the delta and checksum hot loops in wsync._cpu, threaded over chunks.

The extension is optional (setup.py builds it when a compiler is present), so
this module imports it lazily and explains, through BackendUnavailable, why it
is missing. The kernels write bytearrays that are viewed here as numpy arrays
without a copy; they must agree with wsync.codecs.delta_ref byte for byte
(tests/test_backends.py). Payload sections the reference would reject raise
FormatError with the reference's message.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..codecs.delta_ref import DeltaSections
from ..errors import BackendUnavailable, FormatError
from .base import Composed, Overwritten, check_out

# setup.py leaves the compiler's complaint here when the optional build fails.
BUILD_NOTE = Path(__file__).resolve().parent.parent / "_cpu.build-error.txt"
ORDERS = ("float", "int", "uint")


def _import_extension():
    try:
        from .. import _cpu
    except ImportError as e:
        reason = BUILD_NOTE.read_text().strip() if BUILD_NOTE.is_file() else str(e)
        raise BackendUnavailable(
            f"C++ extension wsync._cpu is not built: {reason}; reinstall with a C++ compiler present"
        ) from e
    return _cpu


def _bits(a: np.ndarray, what: str) -> np.ndarray:
    """A 1-D C-contiguous unsigned little-endian view, as the kernels expect."""
    if not isinstance(a, np.ndarray) or a.dtype.kind != "u" or a.dtype.byteorder == ">":
        raise TypeError(f"{what} must be a numpy array of little-endian unsigned bit patterns, got {getattr(a, 'dtype', type(a))}")
    return np.ascontiguousarray(a).reshape(-1)


def _section(a: np.ndarray, dtype, what: str) -> np.ndarray:
    """A section in the dtype the format fixes; anything else is the caller's bug, not bad bytes."""
    if not isinstance(a, np.ndarray) or a.dtype != np.dtype(dtype):
        raise TypeError(f"{what} must be a numpy array of {np.dtype(dtype)}, got {getattr(a, 'dtype', type(a))}")
    return np.ascontiguousarray(a)


def _order(order: str) -> str:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return order


class CpuKernels(Composed):
    name = "cpu"

    def __init__(self):
        self._cpu = _import_extension()
        # For wsync.backend() reports and benchmark records ($WSYNC_THREADS, else $OMP_NUM_THREADS, else CPUs).
        self.threads = self._cpu.max_threads

    def delta_encode(self, old: np.ndarray, new: np.ndarray, order: str) -> DeltaSections:
        return self._encode(old, new, order, False)[0]

    def delta_decode(self, old: np.ndarray, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray]:
        old = _bits(old, "old")
        pos, values = self._call(self._cpu.delta_decode, old, sec, order)
        return np.frombuffer(pos, np.int64), np.frombuffer(values, old.dtype)

    def checksum(self, buf) -> str:
        return f"{self._cpu.checksum(buf):016x}"

    # The fused operations of the Kernels protocol, each one pass over the
    # tensor where Composed's take two or three (wsync/bench/kernels.py
    # measures what that is worth end to end).

    def delta_encode_checksummed(self, old: np.ndarray, new: np.ndarray, order: str,
                                 old_sum: bool = True) -> tuple[DeltaSections, str | None, str]:
        sec, sums = self._encode(old, new, order, 1 if old_sum else 2)
        return sec, *sums

    def write_changes(self, dst: np.ndarray, src: np.ndarray, sec: DeltaSections) -> None:
        if not isinstance(dst, np.ndarray) or dst.ndim != 1 or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise TypeError("write_changes needs a writable 1-D C-contiguous dst")
        src = _bits(src, "src")
        check_out(src, dst, overlap=True)
        try:
            self._cpu.write_changes(dst, src, _section(sec.table, "<u4", "table"), _section(sec.gaps, "<u2", "gaps"),
                                    dst.dtype.itemsize)
        except self._cpu.InvalidSections as e:
            raise FormatError(str(e)) from None

    def delta_decode_checksummed(self, old: np.ndarray, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray, str]:
        old = _bits(old, "old")
        pos, values, old_sum = self._call(self._cpu.delta_decode, old, sec, order, True)
        return np.frombuffer(pos, np.int64), np.frombuffer(values, old.dtype), f"{old_sum:016x}"

    def delta_apply(self, old: np.ndarray, sec: DeltaSections, order: str,
                    out: np.ndarray | None = None) -> tuple[np.ndarray, str, str]:
        old = _bits(old, "old")
        if out is None:
            out = np.empty_like(old)
        check_out(old, out)
        sums = self._call(self._cpu.delta_apply, old, sec, order, out)
        return out, *(f"{s:016x}" for s in sums)

    def delta_apply_inplace(self, bits: np.ndarray, sec: DeltaSections, order: str) -> tuple[Overwritten, str, str]:
        if not isinstance(bits, np.ndarray) or bits.ndim != 1 or not bits.flags.c_contiguous or not bits.flags.writeable:
            raise TypeError("delta_apply_inplace needs a writable 1-D C-contiguous array of bit patterns")
        _bits(bits, "bits")  # dtype check
        pos, saved, before, after = self._call(self._cpu.delta_apply_inplace, bits, sec, order)
        return Overwritten(np.frombuffer(saved, bits.dtype), np.frombuffer(pos, np.int64)), f"{before:016x}", f"{after:016x}"

    def copy_checksummed(self, src, dst: np.ndarray) -> str:
        return f"{self._cpu.copy_checksum(src, dst):016x}"

    def _encode(self, old, new, order, checksums: int) -> tuple[DeltaSections, tuple]:
        """checksums: 0 none, 1 old's and new's, 2 new's only (old's is None)."""
        old, new = _bits(old, "old"), _bits(new, "new")
        if old.dtype != new.dtype or old.shape != new.shape:
            raise ValueError(f"old and new differ: {old.dtype}{list(old.shape)} vs {new.dtype}{list(new.shape)}")
        table, gaps, steps, esc, *sums = self._cpu.delta_encode(old, new, new.dtype.itemsize, _order(order), checksums)
        sec = DeltaSections(
            table=np.frombuffer(table, "<u4"),
            gaps=np.frombuffer(gaps, "<u2"),
            steps=np.frombuffer(steps, np.int8),
            escapes=np.frombuffer(esc, new.dtype.newbyteorder("<")),
        )
        return sec, tuple(None if s is None else f"{s:016x}" for s in sums)

    def _call(self, fn, old: np.ndarray, sec: DeltaSections, order: str, *out):
        """Run a decoding kernel on checked sections; bad payload bytes become FormatError."""
        args = (
            _section(sec.table, "<u4", "table"),
            _section(sec.gaps, "<u2", "gaps"),
            _section(sec.steps, np.int8, "steps"),
            _section(sec.escapes, old.dtype, "escapes"),
        )
        try:
            return fn(old, *args, old.dtype.itemsize, _order(order), *out)
        except self._cpu.InvalidSections as e:
            raise FormatError(str(e)) from None
