"""The raw codec: each tensor's bytes verbatim. Keyframes, first syncs, fast links."""
from __future__ import annotations

from ..snapshot import TensorBits
from .base import Decoded, frombuffer


def encode_tensor(base: TensorBits | None, new: TensorBits, *, tier, kernels, level) -> tuple[str, dict]:
    return "raw", {"data": new.bits}


def decode_tensor(base: TensorBits | None, spec, parts: dict, *, kernels, dtype) -> Decoded:
    return Decoded(frombuffer(parts["data"], dtype.bits_dtype, spec.name))
