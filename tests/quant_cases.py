"""Weights for the quantizing kernels' tests (test_quant_kernels.py, test_cuda_quant.py): every matrix shape class
of a Qwen3-MoE / Kimi-like layer, small enough for the CPU-fiber CUDA harness, as bit patterns of each weight
dtype, with the edge values each format has planted where its groups, rows and blocks will see them."""
from __future__ import annotations

import functools

import numpy as np

from wsync.quant import Fp8Block, Int4Group, Int8Channel, ref

DTYPES = ("BF16", "F16", "F32")
BITS = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}
SIGN = {"BF16": 0x8000, "F16": 0x8000, "F32": 0x80000000}
LARGEST = {"BF16": 0x7F7F, "F16": 0x7BFF, "F32": 0x7F7FFFFF}  # the largest finite value's bits
INF = {"BF16": 0x7F80, "F16": 0x7C00, "F32": 0x7F800000}
NAN = {"BF16": 0x7FC0, "F16": 0x7E00, "F32": 0x7FC00000}
AMAX = 0.90625  # a group's |x| peak whose scale is no power of two (29 / 32: every dtype holds it)
SCHEMES = {"int4_g32": Int4Group(32), "int4_g64": Int4Group(64), "int8_channel": Int8Channel(),
           "fp8_block": Fp8Block()}

# Hidden size, expert intermediate size, experts: H a multiple of the INT4 groups but not of FP8's 128, so the
# FP8 blocks at the matrices' right (and, for rows past 128, bottom) edges are partial.
H, I, E = 192, 96, 4
SHAPES = {
    "q_proj": (320, H), "k_proj": (64, H), "v_proj": (64, H), "o_proj": (H, 320),
    "dense_gate_up": (2 * 224, H), "dense_down": (H, 224),
    "expert_gate": (I, H), "expert_down": (H, I), "fused_experts": (E, 2 * I, H),
    "router": (E, H), "one_row": (1, H),
    "fp8_edges": (130, 200), "fp8_ragged_3d": (2, 257, 136),  # no INT4 (last dimension not a multiple of 32)
}


def fits(scheme, shape) -> bool:
    return scheme.kind != "int4_group" or shape[-1] % scheme.group == 0


def values(dtype: str, floats) -> np.ndarray:
    """Bit patterns of float values that the dtype holds exactly (checked)."""
    f = np.asarray(floats, np.float32)
    bits = ref.round_to(f, dtype)
    assert np.array_equal(ref.to_f32(bits, dtype), f), f"{dtype} cannot hold some of {f}"
    return bits


def near_ties(dtype: str, half: float, amax: float, count: int) -> np.ndarray:
    """Weights x of the dtype for which x / scale (scale: compressed-tensors' of a group whose |x| peaks at amax)
    is not k + 0.5 in float32 but is once rounded to the dtype: where rounding to the dtype first decides the
    integer. Empty for F32 (nothing rounds twice)."""
    if dtype == "F32":
        return np.zeros(0, np.uint32)
    scale = ref.rounded(np.float32(amax) / np.float32(half), dtype)
    bits = np.arange(0, 0x7F00, dtype=np.uint16)
    x = ref.to_f32(bits, dtype)
    ok = np.isfinite(x) & (x <= np.float32(amax))
    q32 = x[ok] / scale
    qd = ref.rounded(q32, dtype)
    hit = (qd % 1 == 0.5) & (q32 != qd)
    found = bits[ok][hit]
    assert len(found), f"no near-tie weights in {dtype}"
    return found[np.linspace(0, len(found) - 1, count).astype(int)]


@functools.lru_cache(maxsize=None)
def weight(shape: tuple[int, ...], dtype: str, seed: int, plant: str) -> np.ndarray:
    """N(0, 0.02) weights as `dtype` bit patterns, shaped `shape`, with edge values for the `plant` format
    ("int": per group / row, "fp8": per 128 x 128 block, "none"). Read-only (cached)."""
    rng = np.random.default_rng(seed)
    w = ref.round_to((rng.standard_normal(shape) * 0.02).astype(np.float32), dtype)
    k = shape[-1]
    flat = w.reshape(-1, k)
    sign, largest = BITS[dtype](SIGN[dtype]), BITS[dtype](LARGEST[dtype])
    rows = flat.shape[0]
    if plant == "int" and rows >= 10 and k >= 128:
        flat[0, :32] = 0  # an all-zero group
        flat[1, :] = 0  # an all-zero row
        flat[2, :32] = sign  # a group of negative zeros
        flat[2, 32:64:3] = sign
        # |x| peaks at 0.9375: an INT4 scale of exactly 0.125, so (k + 0.5) / 8 are exact ties
        flat[3, :32] = np.tile(values(dtype, [0.9375, 0.0625, 0.1875, 0.3125, -0.0625, -0.1875, -0.3125, 0.4375]), 4)
        # a row whose |x| peaks at 127.5 / 128: an INT8 scale of exactly 2**-7, so (k + 0.5) / 128 are ties
        ties = [(j % 127 + 0.5) / 128 * (-1) ** j for j in range(k - 1)]
        flat[4, :] = values(dtype, [127.5 / 128, *ties])
        if dtype != "F32":  # ties that only the rounding to the weight's dtype makes
            flat[5, :31] = near_ties(dtype, 7.5, AMAX, 31)
            flat[5, 31] = values(dtype, [AMAX])[0]
            flat[6, :] = 0
            flat[6, :k - 1] = near_ties(dtype, 127.5, AMAX, k - 1)
            flat[6, k - 1] = values(dtype, [AMAX])[0]
        # subnormals of the dtype: a group of nothing else, and a group with a normal value beside them
        sub = rng.integers(1, 32, size=64).astype(BITS[dtype]) | (sign * rng.integers(0, 2, size=64).astype(BITS[dtype]))
        flat[7, :64] = sub
        flat[7, 40] = values(dtype, [2.0 ** -10])[0]
        # the largest finite values, both signs, in a group and a row of their own
        flat[8, :32] = largest
        flat[8, 1:32:2] = largest | sign
        flat[9, :] = rng.integers(0, int(largest), size=k, dtype=np.int64).astype(BITS[dtype])
        flat[9, 5] = largest | sign
    if plant == "fp8":
        mats = w.reshape(-1, *shape[-2:])
        m, n = shape[-2:]
        mats[0, :128, :128] = 0  # an all-zero block (vLLM's amax floor)
        mats[0, 3 % m, 7 % n] = sign  # with a negative zero in it
        if n > 128:  # |x| peaks at 448: scale 1, so midpoints between e4m3 values are exact ties
            mid = values(dtype, [448, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, -5 * 2.0 ** -10, 0.0])
            mats[0, :128, 128:] = np.resize(np.tile(mid, 17), mats[0, :128, 128:].shape)
            mats[0, 0, 128] = mid[0]
        if m > 128:  # subnormal weights (the amax floor again) and the largest finite values
            mats[0, 128:, :128] = rng.integers(1, 32, size=mats[0, 128:, :128].shape).astype(BITS[dtype])
            mats[0, 129, 5] |= sign
            if n > 128:
                mats[0, 128:, 128:] = rng.integers(0, int(largest), size=mats[0, 128:, 128:].shape,
                                                   dtype=np.int64).astype(BITS[dtype])
                mats[0, m - 1, n - 1] = largest | sign
        if len(mats) > 1:  # a block whose scale is no power of two, its amax the code 448 (x * (1 / scale) ~ 448)
            mats[1, :64, :64] = values(dtype, [300.0])[0]
            mats[1, 2, 2] = values(dtype, [-300.0])[0]
    w.flags.writeable = False
    return w


def cases(scheme):
    """(name, bits, dtype) for every shape class the scheme takes, each dtype, each planting that applies."""
    plant = "fp8" if scheme.kind == "fp8_block" else "int"
    for dtype in DTYPES:
        for i, (name, shape) in enumerate(SHAPES.items()):
            if fits(scheme, shape):
                yield f"{name}/{dtype}", weight(shape, dtype, i, plant), dtype
                yield f"{name}/{dtype}/plain", weight(shape, dtype, 100 + i, "none"), dtype


def non_finite(shape, dtype: str, at: list[tuple[int, ...]], kinds: list[str]) -> np.ndarray:
    """A finite weight with NaN / +inf / -inf at the given indices."""
    w = np.array(weight(tuple(shape), dtype, 7, "none"))
    code = {"nan": NAN[dtype], "+inf": INF[dtype], "-inf": INF[dtype] | SIGN[dtype]}
    for index, kind in zip(at, kinds):
        w[index] = code[kind]
    return w


def empty_outputs(scheme, bits: np.ndarray, dtype: str) -> list[np.ndarray]:
    """Output arrays shaped and typed as the scheme's outputs, filled with junk (nothing may be left unwritten)."""
    rng = np.random.default_rng(bits.size)
    outs = []
    for o in scheme.outputs(bits.shape, dtype):
        a = np.empty(o.shape, {"I32": np.int32, "I64": np.int64, "I8": np.int8, "F8_E4M3": np.uint8,
                               "F32": np.uint32}.get(o.dtype, BITS.get(o.dtype)))
        a.reshape(-1).view(np.uint8)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
        outs.append(a)
    return outs


def same(ours: list[np.ndarray], theirs: list[np.ndarray], what: str) -> None:
    """Byte equality of every output; on a difference, the output and the first differing element."""
    assert len(ours) == len(theirs), what
    for j, (a, b) in enumerate(zip(ours, theirs)):
        b = np.ascontiguousarray(b)
        assert a.shape == b.shape and a.nbytes == b.nbytes, f"{what} output {j}: {a.shape} vs {b.shape}"
        x, y = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
        if not np.array_equal(x, y):
            at = int(np.flatnonzero(x != y)[0]) // a.dtype.itemsize
            raise AssertionError(f"{what} output {j}: element {np.unravel_index(at, a.shape)} differs: "
                                 f"{a.reshape(-1)[at]!r} vs the reference's {b.reshape(-1).view(a.dtype)[at]!r}")
