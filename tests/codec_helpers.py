"""The delta tests' shared cases: base/new bit patterns of every dtype, and the checks that a backend's delta v2
encoder and decoder give the reference's bytes (wsync/codecs/v2_ref.py is the spec)."""
from __future__ import annotations

import numpy as np

from wsync import dtypes
from wsync.codecs import delta_ref, v2_ref
from wsync.errors import FormatError

FLOATS = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def delta_pair(name: str, n: int, rng, density: float = 0.01, big_steps: bool = True):
    """Base/new bit patterns of dtype `name`: small steps mostly, some escapes, the extremes at the ends."""
    dt = dtypes.DTYPES[name]
    bd = dt.bits_dtype
    if name == "BF16":
        old = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    elif name in FLOATS:
        old = (rng.standard_normal(n) * 0.02).astype(FLOATS[name]).view(bd)
    else:
        old = rng.integers(0, 1 << min(8 * dt.itemsize, 63), n, dtype=np.uint64).astype(bd)
    new = old.copy()
    idx = rng.choice(n, max(1, int(n * density)), replace=False)
    choices = [1, -1, 2, -2, 5, -7, 8, -9, 100, -300, 70000] if big_steps else [1, -1, 2]
    steps = rng.choice(choices, len(idx)).astype(np.int64)
    w = 8 * dt.itemsize
    k = delta_ref.monotone_key(old[idx], dt.order).astype(np.uint64) + steps.astype(np.uint64)  # wraps mod 2^64
    if w < 64:
        k &= np.uint64((1 << w) - 1)
    new[idx] = delta_ref.unkey(k.astype(bd), dt.order)
    if n > 2:  # the largest steps there are: +-2^(w-1)
        new[0] = old[0] ^ bd.type(1 << (w - 1))
        new[-1] = ~old[-1]
    return dt, old, new


def twin_matches_reference(k, dt, old, new, what="") -> None:
    """Kernels k encode old -> new to the reference's v2 bytes, and decode those bytes back to v1's
    sections byte for byte."""
    sec = delta_ref.encode(old, new, dt.order)
    want = v2_ref.encode(old, sec, dt)
    got = k.v2_encode(old, sec, dt)
    assert {p: bytes(v) for p, v in got.items()} == want, what
    back = k.v2_decode(old, want, dt)
    for f in ("table", "gaps", "steps", "escapes"):
        assert getattr(back, f).tobytes() == getattr(sec, f).tobytes(), (what, f)


def decodes_as_the_reference(k, old, parts, dt, what="") -> str:
    """The C++ decoder refuses what the reference refuses and decodes the rest to the same sections;
    returns "refused" or "decoded"."""
    try:
        want = v2_ref.decode(old, parts, dt)
    except FormatError:
        want = None
    try:
        got = k.v2_decode(old, parts, dt)
    except FormatError:
        got = None
    assert (want is None) == (got is None), what
    if want is not None:
        for f in ("table", "gaps", "steps", "escapes"):
            assert getattr(want, f).tobytes() == getattr(got, f).tobytes(), (what, f)
    return "refused" if got is None else "decoded"


# ---- the CUDA decoder of delta v2, on the CPU harness (tests/cudasim) -----------------------------------------


def gpu_decode(sim, old: np.ndarray, parts: dict, dt, schedule: str = "forward", runtime=None):
    """The v1 sections the CUDA backend decodes, or FormatError naming the first failing chunk.
    runtime: a cudasim.SimRuntime to launch through, instead of a new one over sim."""
    from cudasim import SimRuntime

    from wsync.backends import cuda

    rt = runtime if runtime is not None else SimRuntime(sim, schedule, seed=11)
    return cuda._Launcher(rt).v2_decode(np.ascontiguousarray(old), parts, dt)


def same_sections(a, b) -> bool:
    return all(getattr(a, f).tobytes() == getattr(b, f).tobytes() and getattr(a, f).dtype == getattr(b, f).dtype
               for f in ("table", "gaps", "steps", "escapes"))


def v2_case(name: str, n: int, seed: int, density: float = 0.01):
    """A delta_pair of dtype `name` from `seed`, and its v2 parts (the reference's encoding)."""
    dt, old, new = delta_pair(name, n, np.random.default_rng(seed), density=density)
    sec = delta_ref.encode(old, new, dt.order)
    return dt, old, v2_ref.encode(old, sec, dt)


def v2_round_trip(runtime) -> None:
    """Every width's v2 kernel through a SimRuntime (tests/test_cuda_sim.py launches every kernel of csrc)."""
    for i, name in enumerate(("U8", "BF16", "F32", "I64")):
        dt, old, parts = v2_case(name, 3000 + i, seed=i)
        assert same_sections(gpu_decode(None, old, parts, dt, runtime=runtime), v2_ref.decode(old, parts, dt)), name
