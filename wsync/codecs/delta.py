"""The lossless delta codec: changed elements only, in three tiers.

`sparse` stores the fixed-width sections of delta_ref (GPU-friendly, no entropy
coder). `packed` runs each section through zstd, with the u16 gaps split into
low- and high-byte planes first: the high bytes are nearly all zero and the low
bytes nearly uniform, and zstd's Huffman stage models each far better alone.
`v2` codes the same changes near their entropy with the base as context
(v2_ref: positions Golomb-coded per base exponent class, steps rANS-coded per
class); decoding it needs the base, so it happens at apply, not in unpack.

Per tensor the encoder picks, from counts it knows before building anything:
  same   nothing changed, nothing stored
  delta  the sparse sections are smaller than the tensor itself
  raw    (sparse tier) dense change: the new bytes verbatim
  xor    (packed tier) dense change: zstd of old XOR new, whose high bits are
         mostly zero because sign and exponent rarely move
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import FormatError
from ..snapshot import TensorBits
from ..tables import Table, as_array
from . import delta_ref
from .base import Applied, Decoded, Encoded, Overwritten, frombuffer, write_whole, zstd_compress, zstd_decompress
from .delta_ref import DeltaSections


def encode_tensor(base: TensorBits, new: TensorBits, *, tier: str, kernels, level: int) -> Encoded:
    return pack(measure(base, new, tier=tier, kernels=kernels), level)


def measure(base: TensorBits, new: TensorBits, *, tier: str, kernels, own: bool = False,
            base_sum: str | None = None) -> Encoded:
    """The first stage of encoding: the one pass over both tensors, before any zstd.

    Yields the tensor's kind, its sections (or dense data) and both checksums;
    pack() finishes it. own: the result must not refer to base's or new's
    memory (the caller will change them before pack() runs). base_sum: the
    base's checksum, when the caller knows it (the pass then hashes only new).
    """
    sec, got, new_sum = kernels.delta_encode_checksummed(base.bits, new.bits, new.dtype.order,
                                                         old_sum=base_sum is None)
    base_sum = base_sum or got
    sums = {"base_sum": base_sum, "new_sum": new_sum}
    if sec.n_changed == 0:
        return Encoded("same", {}, **sums)
    if sec.sparse_size() >= new.nbytes:
        if tier == "sparse":
            data = (new.bits.gather() if isinstance(new.bits, Table) else new.bits.copy()) if own else new.bits
            return Encoded("raw", {"data": data}, verbatim=True, **sums)
        return Encoded("xor", {"data": _xor(kernels, base.bits, new.bits)}, **sums)
    if tier == "v2":
        parts = kernels.v2_encode(base.bits, sec, new.dtype)
        if sum(len(p) for p in parts.values()) >= new.nbytes:  # tiny or odd: the model costs more than it saves
            return Encoded("xor", {"data": _xor(kernels, base.bits, new.bits)}, **sums)
        return Encoded("delta-v2", parts, sections=sec, **sums)
    if tier == "sparse":
        return Encoded("delta-sparse", {"table": sec.table, "gaps": sec.gaps, "steps": sec.steps,
                                        "escapes": sec.escapes}, sections=sec, **sums)
    g = sec.gaps.view(np.uint8)
    return Encoded("delta-packed", {"table": sec.table, "gaps_lo": np.ascontiguousarray(g[0::2]),
                                    "gaps_hi": np.ascontiguousarray(g[1::2]), "steps": sec.steps,
                                    "escapes": sec.escapes}, sections=sec, **sums)


def _xor(kernels, old, new) -> np.ndarray:
    """old ^ new on the host (device kernels compute it where the tensors are and bring it over)."""
    fn = getattr(kernels, "xor", None)
    return fn(old, new) if fn is not None else as_array(old) ^ as_array(new)


def pack(enc: Encoded, level: int) -> Encoded:
    """The second stage: the zstd stage of the packed tier's kinds (the others are already final)."""
    if enc.kind not in _ZSTD_STAGED:
        return enc
    return replace(enc, parts={p: zstd_compress(v, level) for p, v in enc.parts.items()})


_ZSTD_STAGED = ("xor", "delta-packed")


def decode_tensor(base: TensorBits, spec, parts: dict, *, kernels, dtype) -> Decoded:
    bits_dt = dtype.bits_dtype
    if spec.kind == "same":
        return Decoded(np.empty(0, bits_dt), np.empty(0, np.int64))
    if spec.kind == "raw":
        return Decoded(frombuffer(parts["data"], bits_dt, "data"))
    if spec.kind == "xor":
        return Decoded(as_array(base.bits) ^ xor_data(spec, parts, bits_dt))
    sec = kernels.v2_decode(base.bits, parts, dtype) if spec.kind == "delta-v2" \
        else _sections(spec, parts, bits_dt)
    pos, values, base_sum = kernels.delta_decode_checksummed(base.bits, sec, dtype.order)
    return Decoded(values, pos, base_sum)


def unpack(spec, parts: dict, dtype, limit: int | None = None) -> DeltaSections | None:
    """What decoding needs no base for: a delta's sections, out of their zstd stage. The XOR data of a dense
    change is left packed (unpacked, it is as large as the tensor, and it would wait in memory for the base).

    limit: the most bytes the sections may take once unpacked; more raises FormatError before any is
    allocated. Without a base, the tensor's size is only what the manifest declares, so a caller that has
    not checked it against anything passes a limit.
    """
    if spec.kind == "delta-v2":  # its decoding needs the base: apply does it
        return None
    return _sections(spec, parts, dtype.bits_dtype, limit) if spec.kind.startswith("delta") else None


def apply_tensor(base: TensorBits, spec, parts: dict, *, kernels, dtype, inplace: bool, base_sum: bool,
                 unpacked: DeltaSections | None = None) -> Applied:
    """The new tensor, out of place or written into base.bits; base_sum is always taken (it comes free).

    unpacked: the tensor's sections from unpack(), when the caller did that ahead."""
    bits_dt = dtype.bits_dtype
    if spec.kind == "same":
        if inplace:
            s = kernels.checksum(base.bits)
            return Applied(base.bits, s, s)
        out = np.empty(len(base.bits), base.bits.dtype)
        s = kernels.copy_checksummed(base.bits, out)
        return Applied(out, s, s)
    if spec.kind == "raw":
        return write_whole(frombuffer(parts["data"], bits_dt, "data"), base, kernels=kernels, inplace=inplace,
                           base_sum=True)
    if spec.kind == "xor":
        return _apply_xor(base, xor_data(spec, parts, bits_dt), kernels, inplace)
    if unpacked is not None:
        sec = unpacked
    elif spec.kind == "delta-v2":
        sec = kernels.v2_decode(base.bits, parts, dtype)
    else:
        sec = _sections(spec, parts, bits_dt)
    if inplace:
        overwritten, before, after = kernels.delta_apply_inplace(base.bits, sec, dtype.order)
        return Applied(base.bits, after, before, overwritten)
    out, before, after = kernels.delta_apply(base.bits, sec, dtype.order)
    return Applied(out, after, before)


def _apply_xor(base: TensorBits, x: np.ndarray, kernels, inplace: bool) -> Applied:
    # Dense change in the packed tier: zstd dominates, so the plain numpy passes are fine here.
    if not inplace:
        out = as_array(base.bits) ^ x
        return Applied(out, kernels.checksum(out), kernels.checksum(base.bits))
    saved = np.empty(len(base.bits), base.bits.dtype)
    before = kernels.copy_checksummed(base.bits, saved)
    if isinstance(base.bits, Table):
        base.bits.scatter(saved ^ x)
    else:
        np.bitwise_xor(base.bits, x, out=base.bits)
    return Applied(base.bits, kernels.checksum(base.bits), before, Overwritten(saved))


def xor_data(spec, parts: dict, bits_dt) -> np.ndarray:
    return np.frombuffer(zstd_decompress(parts["data"], spec.nbytes, "xor data"), bits_dt)


def _sections(spec, parts: dict, bits_dt, limit: int | None = None) -> DeltaSections:
    if spec.kind == "delta-sparse":  # views of the payload: nothing is allocated
        return _sparse_sections(spec, parts, bits_dt)
    return _packed_sections(spec, parts, bits_dt, limit)


def _sparse_sections(spec, parts: dict, bits_dt) -> DeltaSections:
    return DeltaSections(
        table=frombuffer(parts["table"], "<u4", "table"),
        gaps=frombuffer(parts["gaps"], "<u2", "gaps"),
        steps=frombuffer(parts["steps"], np.int8, "steps"),
        escapes=frombuffer(parts["escapes"], bits_dt, "escapes"),
    )


def _packed_sections(spec, parts: dict, bits_dt, limit: int | None = None) -> DeltaSections:
    nc = delta_ref.nchunks(spec.numel)
    _within(8 * nc, limit, "table")
    table = np.frombuffer(zstd_decompress(parts["table"], 8 * nc, "table"), "<u4")
    # The table is untrusted until delta_decode checks it; bound the sizes it implies first.
    n_changed, n_esc = int(table[:nc].sum(dtype=np.int64)), int(table[nc:].sum(dtype=np.int64))
    if n_esc > n_changed:
        raise FormatError(f"table claims {n_changed} changes, {n_esc} escapes in {spec.numel} elements")
    size = delta_ref.sparse_size(spec.numel, bits_dt.itemsize, n_changed, n_esc)
    if size >= spec.nbytes:  # the encoder stores such a change whole (raw or xor), never as a delta
        raise FormatError(f"table claims {n_changed} changes, {n_esc} escapes in {spec.numel} elements: "
                          f"{size} bytes of sections, more than the {spec.nbytes}-byte tensor")
    _within(size, limit, "sections")
    gaps = np.empty(n_changed, "<u2")
    g = gaps.view(np.uint8)
    g[0::2] = np.frombuffer(zstd_decompress(parts["gaps_lo"], n_changed, "gaps_lo"), np.uint8)
    g[1::2] = np.frombuffer(zstd_decompress(parts["gaps_hi"], n_changed, "gaps_hi"), np.uint8)
    steps = np.frombuffer(zstd_decompress(parts["steps"], n_changed, "steps"), np.int8)
    esc = zstd_decompress(parts["escapes"], n_esc * bits_dt.itemsize, "escapes")
    return DeltaSections(table, gaps, steps, np.frombuffer(esc, bits_dt))


def _within(nbytes: int, limit: int | None, what: str) -> None:
    if limit is not None and nbytes > limit:
        raise FormatError(f"{what}: {nbytes} bytes once unpacked, over the {limit}-byte limit for this payload")
