"""A rank's pieces as streams: one multi-tensor copy or checksum per (trainer, engine) pair and dtype.

Copying and hashing each piece from Python costs a call per piece per version
on both sides (a 30B MoE's trainer rank sends ~20,000 pieces). A piece is a box
of a local tensor, and in memory a box is a run of equal rows (the trailing
dimensions it spans whole and the first one it cuts); so the rows of all of a
pair's pieces, in one order both sides agree on (piece key), make a Table that
the C++ kernels copy and hash in one call. The Tables are built once per
layout and reused while the tensors stay where they are.

A pair's partial digest folds one checksum per bits dtype of that stream, so
the trainer's copy-and-hash, the engine's staged check and its read-back of
the live tensors all hash the same bytes in the same order.
"""
from __future__ import annotations

import numpy as np

from ..snapshot import to_bits
from ..tables import Table

STREAM = "stream:"  # a partial's entries: STREAM + bits dtype -> checksum of the pair's pieces of that dtype


def ordered(pieces) -> list:
    """A pair's pieces in the order both of its ends hash them."""
    return sorted(pieces, key=lambda p: p.key)


def _slices(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


def bits_view(t) -> np.ndarray | None:
    """A writable numpy view of a contiguous CPU tensor's bit patterns, in its shape; None if there is none."""
    if getattr(t, "device", None) is not None and t.device.type != "cpu" or not t.is_contiguous():
        return None
    tb = to_bits(t)
    if t.numel() and tb.bits.__array_interface__["data"][0] != t.data_ptr():
        return None  # to_bits copied: not a view
    return tb.bits.reshape(tuple(t.shape))


def rows(arr: np.ndarray, box) -> list[np.ndarray] | None:
    """The box of `arr` as 1-D C-contiguous views, in C order; None when its innermost rows are strided."""
    v = arr[_slices(box)]
    if v.size == 0:
        return []
    if v.flags.c_contiguous:
        return [v.reshape(-1)]
    for k in range(1, v.ndim):
        if v[(0,) * k].flags.c_contiguous:
            return [v[idx].reshape(-1) for idx in np.ndindex(*v.shape[:k])]
    return None


def tables(arrays_and_boxes) -> dict[str, Table] | None:
    """bits dtype name -> a Table of the rows of (array, box) pairs in order; None if a box has no rows."""
    groups: dict[str, list] = {}
    for arr, box in arrays_and_boxes:
        r = rows(arr, box)
        if r is None:
            return None
        groups.setdefault(arr.dtype.str, []).extend(r)
    return {dt: Table(pieces, np.dtype(dt)) for dt, pieces in groups.items()}


def copy_sums(kernels, src: dict[str, Table], dst: dict[str, Table]) -> dict[str, str]:
    """dst = src, stream by stream, and the checksums of the bytes copied (one call per dtype)."""
    return {STREAM + dt: kernels.copy_checksummed(src[dt], dst[dt]) for dt in sorted(dst)}


def sums(kernels, t: dict[str, Table]) -> dict[str, str]:
    """The checksums of each dtype's stream (one call per dtype)."""
    return {STREAM + dt: kernels.checksum(t[dt]) for dt in sorted(t)}


def device_sums(k, pairs) -> dict[str, str]:
    """sums() of pieces in device memory, the same digests: (tensor, box) pairs (box None: the whole tensor), in
    order; each dtype's stream gathered into one device buffer and hashed on the GPU (k: the device kernels)."""
    from .layout import box_numel

    rt = k.rt
    groups: dict[str, tuple] = {}
    for t, box in pairs:
        dt = rt.dtype_of(t)
        groups.setdefault(dt.bits_dtype.str, (dt, []))[1].append((t, box))
    out = {}
    first = pairs[0][0] if pairs else None
    for key in sorted(groups):
        dt, ps = groups[key]
        n = sum(t.numel() if box is None else box_numel(box) for t, box in ps)
        with rt.stream_of(first):
            flat = rt.empty_tensor(n, dt, rt.device_of(first))
            rt.gather_boxes(flat, ps)
        out[STREAM + key] = k.digest_device(flat)
    return out


class Cache:
    """Tables keyed by where their arrays live: rebuilt only when a tensor moved (a keyframe, a new local)."""

    def __init__(self):
        self._key, self._tables = None, None

    def get(self, key, build):
        if key != self._key:
            self._key, self._tables = key, build()
        return self._tables
