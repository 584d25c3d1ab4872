"""The quantized formats a weight can travel in: which tensors replace it, their names, dtypes and shapes.

Each scheme turns one checkpoint weight ``<module>.weight`` into the tensors the engine's checkpoint holds for
that module in its format, named as the engine's loader expects them:

==============  =====================================  ===========================================
scheme          tensors (for a weight [..., n, k])      the format
==============  =====================================  ===========================================
Int4Group(32)   weight_packed I32 [..., n, k/8]          compressed-tensors "pack-quantized", W4A16
                weight_scale  (weight dtype) [..., n, k/32]  (Kimi K2's routed experts)
                weight_shape  I64 [ndim]
Int8Channel()   weight        I8  [..., n, k]            compressed-tensors "int-quantized", W8A8
                weight_scale  (weight dtype) [..., n, 1]
Fp8Block(128)   weight        F8_E4M3 [..., n, k]         DeepSeek-V3 / Qwen3-FP8 ("fp8", block 128x128)
                weight_scale_inv F32 [..., n/128, k/128]
==============  =====================================  ===========================================

The arithmetic is ``ref.py``'s (each scheme's ``reference``); a backend's kernels compute it
(``Kernels.quantize``, which dispatches on ``kind`` and reads the scheme's parameters).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ref

SUFFIX = "weight"


@dataclass(frozen=True)
class Output:
    suffix: str  # replaces "weight" in the tensor's name
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    def name(self, weight: str) -> str:
        """This output's tensor name for the weight named `weight` ("<module>.weight")."""
        return weight[: -len(SUFFIX)] + self.suffix


@dataclass(frozen=True)
class Int4Group:
    """Symmetric INT4, a scale per `group` elements along the input dimension, packed 8 to an int32."""

    group: int = 32
    format = "pack-quantized"
    kind = "int4_group"  # what a backend's quantize dispatches on

    def outputs(self, shape: tuple[int, ...], dtype: str) -> list[Output]:
        *lead, k = shape
        return [Output("weight_packed", "I32", (*lead, k // 8)), Output("weight_scale", dtype, (*lead, k // self.group)),
                Output("weight_shape", "I64", (len(shape),))]

    def reference(self, bits: np.ndarray, dtype: str, what: str = "tensor") -> list[np.ndarray]:
        packed, scale = ref.int4_group(bits, dtype, self.group, what)
        return [packed, scale, np.asarray(bits.shape, np.int64)]

    def check(self, shape: tuple[int, ...], dtype: str, what: str) -> None:
        _check_float(dtype, what)
        if len(shape) < 2 or shape[-1] % self.group or self.group % 8:
            raise ref.QuantizeError(f"{what}: INT4 groups of {self.group} need a matrix whose last dimension is a "
                                    f"multiple of {self.group}, got shape {list(shape)}")


@dataclass(frozen=True)
class Int8Channel:
    """Symmetric INT8, a scale per output channel (row)."""

    format = "int-quantized"
    kind = "int8_channel"

    def outputs(self, shape: tuple[int, ...], dtype: str) -> list[Output]:
        return [Output("weight", "I8", tuple(shape)), Output("weight_scale", dtype, (*shape[:-1], 1))]

    def reference(self, bits: np.ndarray, dtype: str, what: str = "tensor") -> list[np.ndarray]:
        return list(ref.int8_channel(bits, dtype, what))

    def check(self, shape: tuple[int, ...], dtype: str, what: str) -> None:
        _check_float(dtype, what)
        if len(shape) < 2:
            raise ref.QuantizeError(f"{what}: channel quantization takes a matrix, got shape {list(shape)}")


@dataclass(frozen=True)
class Fp8Block:
    """FP8 e4m3 with a float32 scale per block of the matrix (vLLM's block FP8, DeepSeek's layout)."""

    block: tuple[int, int] = ref.FP8_BLOCK
    format = "fp8-block"
    kind = "fp8_block"

    def outputs(self, shape: tuple[int, ...], dtype: str) -> list[Output]:
        *lead, m, n = shape
        bm, bn = self.block
        return [Output("weight", "F8_E4M3", tuple(shape)),
                Output("weight_scale_inv", "F32", (*lead, -(-m // bm), -(-n // bn)))]

    def reference(self, bits: np.ndarray, dtype: str, what: str = "tensor") -> list[np.ndarray]:
        return list(ref.fp8_block(bits, dtype, self.block, what))

    def check(self, shape: tuple[int, ...], dtype: str, what: str) -> None:
        _check_float(dtype, what)
        if len(shape) < 2:
            raise ref.QuantizeError(f"{what}: block quantization takes a matrix, got shape {list(shape)}")


Scheme = Int4Group | Int8Channel | Fp8Block


def _check_float(dtype: str, what: str) -> None:
    if dtype not in ref.FLOATS:
        raise ref.QuantizeError(f"{what}: the quantizers take {', '.join(ref.FLOATS)} weights, not {dtype}")

