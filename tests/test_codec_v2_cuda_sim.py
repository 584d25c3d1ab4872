"""The CUDA decoder of delta v2 (csrc/ws_v2_cuda.cu), run on CPU fibers (tests/cudasim): byte for byte v2_ref.

One thread per chunk runs ws_v2.cuh's decode_chunk; the host part (parsing the model and the index into
flat tables, as a CUDA backend would) is written here from v2_ref's own parsers. Each case runs under the
forward, reverse and random schedules; corrupt chunks must come back as error codes, never a fault.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsync import dtypes
from wsync.codecs import delta_ref, v2_ref
from wsync.errors import FormatError

cudasim = pytest.importorskip("cudasim")

CSRC = Path(__file__).resolve().parents[1] / "csrc"
C = delta_ref.CHUNK_ELEMS
NBLOCK = C // 128
TABLES = v2_ref.NCLASS + 1 + 3 * 4 * v2_ref.NCLASS + NBLOCK * v2_ref.NCLASS  # csrc/ws_v2_cuda.cu's


@pytest.fixture(scope="module")
def sim():
    if cudasim.compiler() is None:
        pytest.skip("no C++ compiler on PATH: the CUDA harness compiles csrc/*.cu with g++")
    return cudasim.load([CSRC / "ws_v2_cuda.cu"])


def _class_spec(dt):
    if dt.order == "float":
        m = v2_ref.MANTISSA_BITS[dt.name]
        return 0, m, 8 * dt.itemsize - 1 - m
    return (1 if dt.order == "int" else 2), 0, 0


def gpu_decode(sim, old: np.ndarray, parts: dict, dt, schedule: str = "forward", runtime=None):
    """(positions, steps) as the kernel decodes them, or FormatError naming the first failing chunk.
    runtime: a cudasim.SimRuntime to launch through (its block size and schedule), instead of sim."""
    n, w = len(old), old.dtype.itemsize
    k, m, freqs = v2_ref.read_model(parts["model"], n, n * w, w)
    nc = delta_ref.nchunks(n)
    lens = v2_ref.read_index(parts["index"], nc, len(parts["pos"]), len(parts["steps"]))
    lo = min([c for c in range(v2_ref.NCLASS) if m[c]], default=0)
    hi = max([c + 1 for c in range(v2_ref.NCLASS) if m[c]], default=0)
    freq = np.zeros((v2_ref.NCLASS, v2_ref.NSYM), np.uint32)
    cum = np.zeros_like(freq)
    slot = np.zeros((v2_ref.NCLASS, v2_ref.PROB_SCALE), np.uint8)
    for c, f in freqs.items():
        freq[c] = f
        cum[c] = np.concatenate([[0], np.cumsum(f)[:-1]])
        slot[c] = np.repeat(np.arange(v2_ref.NSYM, dtype=np.uint8), f)
    pos_at = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.uint64)
    steps_at = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.uint64)
    span = nc * C
    rank, d, off, step = (np.zeros(span, np.uint32), np.zeros(span, np.int64), np.zeros(span, np.uint32),
                          np.zeros(span, np.int64))
    # scratch as a GPU hands it out: what an earlier decode left there (classes of this tensor's values), so
    # a walk past its chunk reads live-looking classes, not zeros
    junk = np.random.default_rng(span)
    of = v2_ref.value_class(old[junk.integers(0, n, span)], dt).astype(np.uint8)
    cls = of[::-1].copy()
    mark = junk.integers(0, 2**63, nc * C // 64).astype(np.uint64)
    at16 = junk.integers(0, 2**16, span).astype(np.uint16)
    tables = junk.integers(0, 2**32, nc * TABLES).astype(np.uint32)
    count, err = np.zeros(nc, np.uint32), np.zeros(nc, np.int32)
    kind, shift, ebits = _class_spec(dt)
    pos = np.frombuffer(parts["pos"] or b"\0", np.uint8)
    steps = np.frombuffer(parts["steps"] or b"\0", np.uint8)
    i32, u64 = np.int32, np.uint64
    args = (np.ascontiguousarray(old), u64(n), np.array(m, np.uint64), freq.ravel(), cum.ravel(), slot.ravel(),
            i32(lo), i32(hi), i32(kind), i32(shift), i32(ebits), u64(k), pos, pos_at, steps, steps_at,
            rank, cls, d, of, mark, at16, tables, off, step, count, err)
    if runtime is not None:
        runtime.launch(f"v2_decode_{w}", -(-nc // runtime.block), args)
    else:
        sim.launch(f"v2_decode_{w}", (nc + 31) // 32, 32, args, schedule=schedule, seed=11)
    bad = np.flatnonzero(err)
    if len(bad):
        raise FormatError(f"v2 chunk {bad[0]}: error {err[bad[0]]}")
    if int(count.sum()) != k:
        raise FormatError(f"v2: decoded {int(count.sum())} changes, the model declares {k}")
    p = np.concatenate([c * C + off[c * C:c * C + count[c]].astype(np.int64) for c in range(nc)])
    s = np.concatenate([step[c * C:c * C + count[c]] for c in range(nc)])
    return p, s


def _case(name: str, n: int, seed: int, density: float = 0.01):
    from test_codec_v2 import _pair

    dt, old, new = _pair(name, n, np.random.default_rng(seed), density=density)
    sec = delta_ref.encode(old, new, dt.order)
    return dt, old, v2_ref.encode(old, sec, dt)


@pytest.mark.parametrize("name,n", [("BF16", 2 * C + 4099), ("F32", C + 1), ("I8", 5000), ("U64", 3000),
                                    ("F8_E5M2", C - 1), ("BF16", C + 2), ("BF16", C + 5)])
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_kernel_decodes_what_the_reference_decodes(sim, name, n, schedule):
    dt, old, parts = _case(name, n, seed=n)
    want_pos, want_d = v2_ref.decode_changes(old, parts, dt)
    pos, d = gpu_decode(sim, old, parts, dt, schedule)
    assert pos.tobytes() == want_pos.tobytes() and d.tobytes() == want_d.tobytes()


def test_kernel_refuses_corrupt_chunks_as_the_reference_does(sim):
    """Bit flips in the chunk streams: the kernel reports an error exactly where the reference raises."""
    dt, old, parts = _case("BF16", C + 2000, seed=1, density=0.005)
    rng = np.random.default_rng(2)
    for part in ("pos", "steps"):
        for _ in range(8):
            b = bytearray(parts[part])
            b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
            bad = {**parts, part: bytes(b)}
            try:
                want = v2_ref.decode_changes(old, bad, dt)
            except FormatError:
                want = None
            try:
                got = gpu_decode(sim, old, bad, dt, "random")
            except FormatError:
                got = None
            assert (want is None) == (got is None), part
            if want is not None:
                assert want[0].tobytes() == got[0].tobytes() and want[1].tobytes() == got[1].tobytes()


def v2_round_trip(runtime) -> None:
    """Every width's v2 kernel through a SimRuntime (tests/test_cuda_sim.py launches every kernel of csrc)."""
    for i, name in enumerate(("U8", "BF16", "F32", "I64")):
        dt, old, parts = _case(name, 3000 + i, seed=i)
        want_pos, want_d = v2_ref.decode_changes(old, parts, dt)
        pos, d = gpu_decode(None, old, parts, dt, runtime=runtime)
        assert pos.tobytes() == want_pos.tobytes() and d.tobytes() == want_d.tobytes(), name
