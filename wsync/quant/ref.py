"""The quantizers, written to be read: the spec every backend's kernels must equal byte for byte.

Each one makes what the serving engine's own quantizer makes of the same weights, so an engine that loads
what wsync sends holds the bytes it would have made itself from the trainer's BF16 weights:

- ``int4_group``: compressed-tensors' symmetric INT4 group quantization with its "pack-quantized" packing
  (``calculate_qparams``, ``quantize``, ``pack_to_int32``): the Kimi K2 routed-expert format.
- ``int8_channel``: compressed-tensors' symmetric INT8 channel quantization ("int-quantized", W8A8).
- ``fp8_block``: vLLM's 128x128 block FP8 e4m3 cast (``per_block_cast_to_fp8``): the DeepSeek-V3 /
  Qwen3-FP8 layout, ``weight_scale_inv`` beside the codes.

The arithmetic is theirs, step by step, including where they round:

- compressed-tensors works in the weight's dtype. Its scale is ``absmax / (range / 2)`` (7.5 for INT4, 127.5
  for INT8), divided in float32 and rounded to the weight's dtype; ``x / scale`` is divided in float32 and
  rounded to the weight's dtype *before* the rounding to an integer.
- vLLM's block cast works in float32: ``sf = max(amax, 1e-4) / 448``, codes ``fp8(x * (1 / sf))`` (a
  multiply by the reciprocal, not a division).

Policy where the engines' code gives no answer or a bad one:

- NaN or infinity in a tensor: refused (``QuantizeError`` names the element). compressed-tensors would make a
  NaN scale and codes that depend on the CPU's float-to-int conversion.
- An all-zero group or channel: scale is the scale dtype's epsilon (compressed-tensors' own rule) and every code
  0; an all-zero FP8 block: scale ``1e-4 / 448`` (vLLM's clamp), every code 0.
- Ties round to even, both in the rounding to the weight's dtype and in the rounding to an integer
  (``torch.round``), and in the cast to FP8.
- A shape the format cannot hold (INT4: a last dimension not a multiple of the group) is refused, as
  compressed-tensors refuses it.

Arrays here are bit patterns (``uint16`` for BF16/F16, ``uint32`` for F32), as everywhere in wsync.
"""
from __future__ import annotations

import numpy as np

from ..errors import WsyncError

FLOATS = ("BF16", "F16", "F32")  # the weight dtypes the quantizers take
EPS = {"BF16": 2.0 ** -7, "F16": 2.0 ** -10, "F32": 2.0 ** -23}  # torch.finfo(dtype).eps
INT4_MAX, INT4_MIN = 7, -8
INT8_MAX, INT8_MIN = 127, -128
FP8_MAX = 448.0  # float8_e4m3fn
FP8_AMAX_FLOOR = np.float32(1e-4)  # vLLM clamps a block's amax to this
FP8_BLOCK = (128, 128)


class QuantizeError(WsyncError, ValueError):
    """A tensor the quantizer refuses: not finite, or a shape its format cannot hold."""


# ---- float helpers: exact conversions, in numpy ------------------------------------------------------------

def to_f32(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of bit patterns (exact: every BF16/F16 value is a float32)."""
    if dtype == "BF16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return bits.view(np.float16).astype(np.float32)
    if dtype == "F32":
        return bits.view(np.float32)
    raise QuantizeError(f"the quantizers take {', '.join(FLOATS)} weights, not {dtype}")


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` (nearest, ties to even), as bit patterns of that dtype."""
    if dtype == "BF16":
        u = values.astype(np.float32).view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    if dtype == "F16":
        return values.astype(np.float16).view(np.uint16)
    return values.astype(np.float32).view(np.uint32)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` and read back as float32 (what a torch op in that dtype returns)."""
    return to_f32(round_to(values, dtype), dtype)


def fp8_e4m3(values: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn bit patterns, nearest with ties to even, as torch's ``.to(float8_e4m3fn)``:
    the format has no infinity, so a magnitude of 448 or more (infinity too) saturates to 448, and NaN is NaN."""
    u = values.astype(np.float32).view(np.uint32)
    sign = ((u >> 24) & 0x80).astype(np.uint8)
    a = u & np.uint32(0x7FFFFFFF)
    out = np.empty(a.shape, np.uint8)
    big = a >= np.uint32(0x43E00000)  # 448.0 and beyond
    small = a < np.uint32(121 << 23)  # below 2**-6: the format's subnormals
    normal = ~big & ~small
    an = a[normal]
    # re-bias the exponent (127 -> 7) and round the 20 bits dropped from the mantissa to even
    out[normal] = ((an - np.uint32(120 << 23) + np.uint32(0x7FFFF) + ((an >> 20) & 1)) >> 20).astype(np.uint8)
    # a subnormal's code is its value in units of 2**-9; 8 units is the smallest normal, code 0x08 as well
    out[small] = np.rint(a[small].view(np.float32) * np.float32(512)).astype(np.uint8)
    out[big] = 0x7E
    out[a > np.uint32(0x7F800000)] = 0x7F
    return out | sign


def check_finite(values: np.ndarray, what: str) -> None:
    bad = ~np.isfinite(values)
    if bad.any():
        at = int(np.flatnonzero(bad.reshape(-1))[0])
        raise QuantizeError(f"{what}: element {at} (flat index) is {values.reshape(-1)[at]}; the quantizers "
                            f"refuse NaN and infinity ({int(bad.sum())} such elements)")


# ---- compressed-tensors: symmetric integer quantization -------------------------------------------------------

def _symmetric(x: np.ndarray, dtype: str, q_min: int, q_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8, scale bits) for x [..., n] quantized with one scale per last-axis row, as
    compressed-tensors' ``calculate_qparams`` then ``quantize`` do in the weight's dtype."""
    lo = np.minimum(x.min(axis=-1, keepdims=True), np.float32(0))
    hi = np.maximum(x.max(axis=-1, keepdims=True), np.float32(0))
    absmax = np.maximum(np.abs(lo), np.abs(hi))
    half_range = np.float32((q_max - q_min) / 2)  # 7.5, 127.5: exact in every float dtype used
    scale = rounded(absmax / half_range, dtype)
    scale = np.where(scale == 0, np.float32(EPS[dtype]), scale)
    q = rounded(x / scale, dtype)  # compressed-tensors divides in the weight's dtype: rounded before rint
    codes = np.rint(np.clip(q, q_min, q_max)).astype(np.int8)
    return codes, round_to(scale, dtype)


def int4_group(bits: np.ndarray, dtype: str, group: int = 32, what: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT4, one scale per `group` consecutive elements of the last axis, packed.

    bits: [..., k] patterns of a BF16/F16/F32 weight, k a multiple of `group` (and of 8).
    Returns (packed int32 [..., k/8]: element j of a row in bits 4*(j%8).. of word j//8, as its code + 8;
    scale bit patterns in the weight's dtype [..., k/group])."""
    if bits.ndim < 1 or bits.shape[-1] % group or group % 8:
        raise QuantizeError(f"{what}: INT4 groups of {group} need a last dimension that is a multiple of {group} "
                            f"(and groups a multiple of 8), got shape {list(bits.shape)}")
    x = to_f32(bits, dtype)
    check_finite(x, what)
    lead, k = bits.shape[:-1], bits.shape[-1]
    codes, scale = _symmetric(x.reshape(*lead, k // group, group), dtype, INT4_MIN, INT4_MAX)
    return pack_int4(codes.reshape(*lead, k)), scale.reshape(*lead, k // group)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """int8 codes in [-8, 7], [..., k] with k % 8 == 0 -> int32 [..., k/8], compressed-tensors' packing."""
    nibbles = (codes.astype(np.int32) + 8).astype(np.uint32).reshape(*codes.shape[:-1], -1, 8)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return np.bitwise_or.reduce(nibbles << shifts, axis=-1).view(np.int32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """pack_int4's inverse: int32 [..., k/8] -> int8 codes [..., k]."""
    words = packed.view(np.uint32)[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)
    return ((words & 0xF).astype(np.int8) - 8).reshape(*packed.shape[:-1], -1)


def int8_channel(bits: np.ndarray, dtype: str, what: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8, one scale per output channel (row): (codes int8 [..., n, k], scale bits [..., n, 1])."""
    if bits.ndim < 2:
        raise QuantizeError(f"{what}: channel quantization takes a matrix, got shape {list(bits.shape)}")
    x = to_f32(bits, dtype)
    check_finite(x, what)
    return _symmetric(x, dtype, INT8_MIN, INT8_MAX)


# ---- vLLM: 128x128 block FP8 ----------------------------------------------------------------------------------

def fp8_block(bits: np.ndarray, dtype: str, block: tuple[int, int] = FP8_BLOCK,
              what: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """FP8 e4m3 codes with one float32 scale per block: (codes uint8 [..., m, n], scale_inv f32
    [..., ceil(m/bm), ceil(n/bn)]). Edge blocks are the part of the matrix they cover (vLLM pads with zeros,
    which changes no block's amax)."""
    if bits.ndim < 2:
        raise QuantizeError(f"{what}: block quantization takes a matrix, got shape {list(bits.shape)}")
    x = to_f32(bits, dtype)
    check_finite(x, what)
    bm, bn = block
    *lead, m, n = x.shape
    rb, cb = -(-m // bm), -(-n // bn)
    padded = np.zeros((*lead, rb * bm, cb * bn), np.float32)
    padded[..., :m, :n] = x
    blocks = padded.reshape(*lead, rb, bm, cb, bn)
    amax = np.maximum(np.abs(blocks).max(axis=(-3, -1), keepdims=True), FP8_AMAX_FLOOR)
    sf = amax / np.float32(FP8_MAX)
    codes = fp8_e4m3(blocks * (np.float32(1) / sf))
    codes = codes.reshape(*lead, rb * bm, cb * bn)[..., :m, :n]
    return np.ascontiguousarray(codes), np.ascontiguousarray(sf.reshape(*lead, rb, cb))
