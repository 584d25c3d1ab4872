"""The lossless delta codec: changed elements only, in two tiers.

`sparse` stores the fixed-width sections of delta_ref (GPU-friendly, no entropy
coder). `packed` runs each section through zstd, with the u16 gaps split into
low- and high-byte planes first: the high bytes are nearly all zero and the low
bytes nearly uniform, and zstd's Huffman stage models each far better alone.

Per tensor the encoder picks, from counts it knows before building anything:
  same   nothing changed, nothing stored
  delta  the sparse sections are smaller than the tensor itself
  raw    (sparse tier) dense change: the new bytes verbatim
  xor    (packed tier) dense change: zstd of old XOR new, whose high bits are
         mostly zero because sign and exponent rarely move
"""
from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..snapshot import TensorBits
from . import delta_ref
from .base import Decoded, frombuffer, zstd_compress, zstd_decompress
from .delta_ref import DeltaSections


def encode_tensor(base: TensorBits, new: TensorBits, *, tier: str, kernels, level: int) -> tuple[str, dict]:
    sec = kernels.delta_encode(base.bits, new.bits, new.dtype.order)
    if sec.n_changed == 0:
        return "same", {}
    if sec.sparse_size() >= new.nbytes:
        if tier == "sparse":
            return "raw", {"data": new.bits}
        return "xor", {"data": zstd_compress(base.bits ^ new.bits, level)}
    if tier == "sparse":
        return "delta-sparse", {"table": sec.table, "gaps": sec.gaps, "steps": sec.steps, "escapes": sec.escapes}
    g = sec.gaps.view(np.uint8)
    return "delta-packed", {
        "table": zstd_compress(sec.table, level),
        "gaps_lo": zstd_compress(np.ascontiguousarray(g[0::2]), level),
        "gaps_hi": zstd_compress(np.ascontiguousarray(g[1::2]), level),
        "steps": zstd_compress(sec.steps, level),
        "escapes": zstd_compress(sec.escapes, level),
    }


def decode_tensor(base: TensorBits, spec, parts: dict, *, kernels, dtype) -> Decoded:
    bits_dt = dtype.bits_dtype
    if spec.kind == "same":
        return Decoded(np.empty(0, bits_dt), np.empty(0, np.int64))
    if spec.kind == "raw":
        return Decoded(frombuffer(parts["data"], bits_dt, spec.name))
    if spec.kind == "xor":
        x = zstd_decompress(parts["data"], spec.nbytes, f"{spec.name}: xor data")
        return Decoded(base.bits ^ np.frombuffer(x, bits_dt))
    sec = _sparse_sections(spec, parts, bits_dt) if spec.kind == "delta-sparse" else _packed_sections(spec, parts, bits_dt)
    try:
        pos, values = kernels.delta_decode(base.bits, sec, dtype.order)
    except FormatError as e:
        raise FormatError(f"{spec.name}: {e}") from None
    return Decoded(values, pos)


def _sparse_sections(spec, parts: dict, bits_dt) -> DeltaSections:
    return DeltaSections(
        table=frombuffer(parts["table"], "<u4", f"{spec.name}: table"),
        gaps=frombuffer(parts["gaps"], "<u2", f"{spec.name}: gaps"),
        steps=frombuffer(parts["steps"], np.int8, f"{spec.name}: steps"),
        escapes=frombuffer(parts["escapes"], bits_dt, f"{spec.name}: escapes"),
    )


def _packed_sections(spec, parts: dict, bits_dt) -> DeltaSections:
    nc = delta_ref.nchunks(spec.numel)
    table = np.frombuffer(zstd_decompress(parts["table"], 8 * nc, f"{spec.name}: table"), "<u4")
    # The table is untrusted until delta_decode checks it; bound the sizes it implies first.
    n_changed, n_esc = int(table[:nc].sum(dtype=np.int64)), int(table[nc:].sum(dtype=np.int64))
    if n_changed > spec.numel or n_esc > n_changed:
        raise FormatError(f"{spec.name}: table claims {n_changed} changes, {n_esc} escapes in {spec.numel} elements")
    gaps = np.empty(n_changed, "<u2")
    g = gaps.view(np.uint8)
    g[0::2] = np.frombuffer(zstd_decompress(parts["gaps_lo"], n_changed, f"{spec.name}: gaps_lo"), np.uint8)
    g[1::2] = np.frombuffer(zstd_decompress(parts["gaps_hi"], n_changed, f"{spec.name}: gaps_hi"), np.uint8)
    steps = np.frombuffer(zstd_decompress(parts["steps"], n_changed, f"{spec.name}: steps"), np.int8)
    esc = zstd_decompress(parts["escapes"], n_esc * bits_dt.itemsize, f"{spec.name}: escapes")
    return DeltaSections(table, gaps, steps, np.frombuffer(esc, bits_dt))
