"""Many tensors as one element stream: the unit of work of a bucket.

A mixture-of-experts state has tens of thousands of tensors. Paying a kernel
call, a chunk table and three checksums per tensor would make that overhead,
not the bytes, what such a state costs. So the codecs work
on *segments*: the tensors of one dtype in one bucket, back to back, as one
virtual 1-D array of bit patterns. A ``Table`` is that array without the copy:
the address and byte range of each piece, which the C++ kernels walk in one
call (like apex ``multi_tensor_apply`` or torch ``_foreach_*``). Positions and
checksums are those of the concatenation, so the reference backend, which
simply gathers the pieces, is the spec.

A Table is built once per layout (``wsync.bind``) and reused every version:
building one costs a Python step per tensor, using it costs none.
"""
from __future__ import annotations

import numpy as np


class Table:
    """A virtual 1-D array of one bits dtype: ``pieces`` (1-D arrays) back to back.

    The pieces must stay alive and in place while the Table is used; the
    Table holds references to them, so they cannot be freed under it.
    """

    ndim = 1

    def __init__(self, pieces: list[np.ndarray], dtype):
        self.dtype = np.dtype(dtype)
        self.pieces = pieces
        n = len(pieces)
        self.addrs = np.empty(n, np.int64)
        self.starts = np.zeros(n + 1, np.int64)  # byte offset of each piece in the stream; last: total bytes
        for i, p in enumerate(pieces):
            if p.dtype != self.dtype or p.ndim != 1 or not p.flags.c_contiguous:
                raise TypeError(f"piece {i}: expected a 1-D C-contiguous {self.dtype} array, got {p.dtype}{list(p.shape)}")
            self.addrs[i] = p.__array_interface__["data"][0]
            self.starts[i + 1] = self.starts[i] + p.nbytes
        self.writable = all(p.flags.writeable for p in pieces)

    @property
    def nbytes(self) -> int:
        return int(self.starts[-1])

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def __len__(self) -> int:
        return self.size

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    def arg(self) -> tuple[np.ndarray, np.ndarray]:
        """What the C++ kernels take in place of a buffer: (addresses, byte starts), both int64."""
        return self.addrs, self.starts

    def element_starts(self) -> np.ndarray:
        """Element offset of each piece (and the total, last)."""
        return self.starts // self.dtype.itemsize

    def gather(self, out: np.ndarray | None = None) -> np.ndarray:
        """The stream as one contiguous array (a copy)."""
        if out is None:
            out = np.empty(self.size, self.dtype)
        if self.pieces:
            np.concatenate(self.pieces, out=out)
        return out

    def scatter(self, values: np.ndarray) -> None:
        """Write a whole stream's worth of values into the pieces."""
        if not self.writable:
            raise TypeError("this table's pieces are read-only")
        at = self.element_starts()
        for i, p in enumerate(self.pieces):
            p[...] = values[at[i] : at[i + 1]]

    def put(self, positions: np.ndarray, values: np.ndarray) -> None:
        """Write values at stream positions (int64, any order)."""
        if not self.writable:
            raise TypeError("this table's pieces are read-only")
        if len(positions) == 0:
            return
        at = self.element_starts()
        piece = np.searchsorted(at, positions, side="right") - 1
        for i in np.unique(piece):
            sel = piece == i
            self.pieces[i][positions[sel] - at[i]] = values[sel]

    def take(self, positions: np.ndarray) -> np.ndarray:
        """The values at stream positions."""
        out = np.empty(len(positions), self.dtype)
        if len(positions) == 0:
            return out
        at = self.element_starts()
        piece = np.searchsorted(at, positions, side="right") - 1
        for i in np.unique(piece):
            sel = piece == i
            out[sel] = self.pieces[i][positions[sel] - at[i]]
        return out

    def __repr__(self) -> str:
        return f"Table({len(self.pieces)} pieces, {self.size} x {self.dtype})"


def read(bits, positions: np.ndarray | None) -> np.ndarray:
    """A copy of bits (an array or a Table) at int64 positions, or all of it for None."""
    if isinstance(bits, Table):
        return bits.gather() if positions is None else bits.take(positions)
    return bits.copy() if positions is None else bits[positions]


def write(bits, positions: np.ndarray | None, values: np.ndarray) -> None:
    """bits[positions] = values for an array or a Table; positions None: every element."""
    if isinstance(bits, Table):
        bits.scatter(values) if positions is None else bits.put(positions, values)
    elif positions is None:
        bits[:] = values
    else:
        bits[positions] = values


def byte_size(v) -> int:
    """Bytes in v: an array, a Table or a device tensor (each says its nbytes), or any buffer."""
    n = getattr(v, "nbytes", None)
    return n if isinstance(n, int) else memoryview(v).nbytes


def as_array(bits) -> np.ndarray:
    """A contiguous array of the stream: bits itself, or a gathered copy of a Table."""
    return bits.gather() if isinstance(bits, Table) else bits
