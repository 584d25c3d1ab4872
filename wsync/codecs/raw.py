"""The raw codec: each tensor's bytes verbatim. Keyframes, first syncs, fast links."""
from __future__ import annotations

from ..snapshot import TensorBits
from .base import Applied, Decoded, Encoded, frombuffer, write_whole


def encode_tensor(base: TensorBits | None, new: TensorBits, *, tier, kernels, level) -> Encoded:
    return Encoded("raw", {"data": new.bits}, verbatim=True)


def decode_tensor(base: TensorBits | None, spec, parts: dict, *, kernels, dtype) -> Decoded:
    return Decoded(frombuffer(parts["data"], dtype.bits_dtype, "data"))


def unpack(spec, parts: dict, dtype, limit: int | None = None) -> None:
    """Nothing to decode ahead of the base: the bytes are the tensor."""
    return None


def apply_tensor(base: TensorBits | None, spec, parts: dict, *, kernels, dtype, inplace: bool,
                 base_sum: bool, unpacked=None) -> Applied:
    """The data as the new tensor; base only matters in place (it is the target)."""
    values = frombuffer(parts["data"], dtype.bits_dtype, "data")
    return write_whole(values, base, kernels=kernels, inplace=inplace, base_sum=base_sum)
