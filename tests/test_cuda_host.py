"""The CUDA backend's logic, checked on a machine without a GPU.

csrc/delta_cuda.cu also builds as host C++ (-DWSYNC_HOST_TEST): every kernel
becomes a serial function of the same name that loops over the grid, built
from the same per-element helpers, the same vector/mask-word/tile grouping and
the same exclusive scans. Driving those through wsync.backends.cuda's _Engine
with numpy in place of cupy runs the backend's whole host-side choreography
(launch order, prefix sums, validation, error messages), so only the shuffles,
barriers and the hardware itself are left for tests/test_cuda_kernels.py.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsync.backends import cuda
from wsync.checksum import BLOCK, block_digests, checksum
from wsync.codecs import delta_ref
from wsync.errors import FormatError

CSRC = Path(__file__).resolve().parents[1] / "csrc"
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
CASES = [(w, o) for w in (1, 2, 4, 8) for o in ("float", "int", "uint")]
SIZES = st.one_of(
    st.integers(0, 300),
    st.sampled_from([65535, 65536, 65537, 2 * 65536 + 7, 3 * 65536]),
    st.integers(1, 150_000),
)
DENSITY = st.one_of(st.sampled_from([0.0, 1.0, 1e-4]), st.floats(0.0, 1.0))
CHECKED = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="session")
def hostlib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH: the host build of csrc/delta_cuda.cu needs g++")
    out = tmp_path_factory.mktemp("cuda_host") / "libwsync_cuda_host.so"
    cmd = [cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-x", "c++",
           "-DWSYNC_HOST_TEST", str(CSRC / "delta_cuda.cu"), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"host build failed:\n{r.stderr[-4000:]}"
    lib = ctypes.CDLL(str(out))
    for f in (lib.wsh_xxh3_64, lib.wsh_xxh3_64_lanes):
        f.restype, f.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_uint64]
    lib.wsh_bf16_round.restype = None
    lib.wsh_bf16_round.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32]
    return lib


class HostRuntime:
    """The runtime interface of cuda._Engine, launching the host build instead of cupy."""

    xp = np

    def __init__(self, lib):
        self.lib = lib

    def launch(self, name, grid, args):
        fn = getattr(self.lib, name)
        fn.restype = None
        fn(ctypes.c_uint64(grid), *[_c_arg(a) for a in args])

    @staticmethod
    def to_host(x):
        return np.asarray(x)

    @staticmethod
    def ptr(x):
        return x.ctypes.data


def _c_arg(a):
    if isinstance(a, np.ndarray):
        assert a.flags.c_contiguous
        return ctypes.c_void_p(a.ctypes.data)
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a))
    if isinstance(a, np.uint32):
        return ctypes.c_uint32(int(a))
    raise TypeError(f"kernel argument of type {type(a).__name__}")


@pytest.fixture(scope="session")
def host_kernels(hostlib):
    return cuda._KernelsOver(HostRuntime(hostlib))


def make_case(rng, width: int, order: str, n: int, density: float):
    """Bit patterns old -> new: mostly one- to three-step moves (also across zero),
    some large jumps (escapes), runs of neighbours, and special values (NaN, inf, ±0)."""
    u = UINT[width]
    info = np.iinfo(u)
    old = rng.integers(0, info.max, size=n, dtype=u, endpoint=True)
    special = np.array([0, 1, info.max, info.max >> 1, (info.max >> 1) + 1, (info.max >> 1) + 2], dtype=u)
    if width >= 2:  # float specials of this width: +inf, -inf, a quiet NaN, -NaN
        exp_bits = {2: 5, 4: 8, 8: 11}[width]
        inf = ((1 << exp_bits) - 1) << (8 * width - 1 - exp_bits)
        sign = 1 << (8 * width - 1)
        quiet = 1 << (8 * width - 2 - exp_bits)
        special = np.concatenate([special, np.array([inf, inf | sign, inf | quiet, inf | quiet | sign], dtype=u)])
    old[rng.random(n) < 0.05] = rng.choice(special)
    new = old.copy()
    changed = np.flatnonzero(rng.random(n) < density)
    if n > 40 and density > 0:  # a run of adjacent changes
        s = int(rng.integers(0, n - 40))
        changed = np.union1d(changed, np.arange(s, s + 40))
    how = rng.integers(0, 10, size=len(changed))
    key = delta_ref.monotone_key(old[changed], order)
    step = rng.choice(np.array([-3, -2, -1, 1, 2, 3, 127, -127, 128, -128], dtype=np.int64), size=len(changed))
    moved = delta_ref.unkey((key + step.astype(u)).astype(u), order)
    jump = rng.integers(0, info.max, size=len(changed), dtype=u, endpoint=True)
    new[changed] = np.where(how < 7, moved, np.where(how < 9, jump, rng.choice(special, size=len(changed))))
    return old, new


def sections_equal(a: delta_ref.DeltaSections, b: delta_ref.DeltaSections) -> bool:
    return all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in
               ((a.table, b.table), (a.gaps, b.gaps), (a.steps, b.steps), (a.escapes, b.escapes)))


# ---- xxh3 ------------------------------------------------------------------------------

XXH3_LENGTHS = list(range(0, 301)) + [
    511, 512, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 4096 + 63, 65536 + 3, 123_457,
    BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17,
]


@pytest.mark.parametrize("probe", ["wsh_xxh3_64", "wsh_xxh3_64_lanes"])
def test_xxh3_matches_xxhash_on_every_length_class(hostlib, probe):
    rng = np.random.default_rng(7)
    fn = getattr(hostlib, probe)
    data = rng.integers(0, 256, size=max(XXH3_LENGTHS) + 8, dtype=np.uint8)
    for n in XXH3_LENGTHS:
        for start in (0, 3):  # an odd start: the last stripe and short paths read unaligned words
            view = data[start : start + n]
            assert fn(view.ctypes.data, n) == xxhash.xxh3_64_intdigest(view.tobytes()), f"{probe}, len {n}, start {start}"


def test_block_digests_match_the_checksum_module(host_kernels):
    rng = np.random.default_rng(8)
    raw = rng.integers(0, 256, size=3 * BLOCK + 1000, dtype=np.uint8)
    bufs = [raw[: 3 * BLOCK + 17], raw[:0], raw[1:241], raw[5 : 5 + BLOCK], raw[:BLOCK + 1], raw[3:4]]
    got = host_kernels.engine.block_digests(bufs)
    for b, d in zip(bufs, got):
        assert d.tobytes() == block_digests(b).tobytes()
    assert host_kernels.engine.digests(bufs) == [checksum(b) for b in bufs]


# ---- bf16 rounding -------------------------------------------------------------------------


def _round_host(lib, f32_bits: np.ndarray, nan_bits) -> np.ndarray:
    f32_bits = np.ascontiguousarray(f32_bits, dtype=np.uint32)
    out = np.empty(len(f32_bits), dtype=np.uint16)
    lib.wsh_bf16_round(f32_bits.ctypes.data, out.ctypes.data, len(f32_bits), *nan_bits)
    return out


def _round_torch(f32_bits: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(f32_bits, dtype=np.uint32).view(np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_torch_maps_every_nan_to_one_pattern_per_sign():
    """The kernel's assumption: the NaN a cast yields depends on the sign at most, not the payload."""
    rng = np.random.default_rng(9)
    payload = rng.integers(1, 1 << 23, size=4096, dtype=np.uint32)
    pos = np.concatenate([[1, 0x400000, 0x7FFFFF, 0x3FFFFF], payload]).astype(np.uint32) | 0x7F800000  # sNaN and qNaN
    for sign, expect in zip((0, 0x80000000), cuda.torch_bf16_nan_bits("cpu")):
        got = _round_torch(pos | np.uint32(sign))
        assert (got == expect).all(), sorted(set(got.tolist()))


def test_bf16_rounding_matches_torch(hostlib):
    rng = np.random.default_rng(10)
    nan = cuda.torch_bf16_nan_bits("cpu")
    # Every sign/exponent/upper-mantissa pattern with the low halves where rounding decides.
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], dtype=np.uint32)
    grid = (hi[:, None] | lows[None, :]).reshape(-1)
    rand = rng.integers(0, 1 << 32, size=3_000_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
                        0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF,
                        0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x3F808000, 0x3F818000, 0x3F7FFFFF], dtype=np.uint32)
    for x in (special, grid, rand):
        assert (_round_host(hostlib, x, nan) == _round_torch(x)).all()


def test_bf16_scalar_path_pattern_is_a_parameter(hostlib):
    # torch's scalar CPU cast says 0x7FC0; pass that and the kernel says it too.
    scalar = int(torch.tensor(float("nan")).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    x = np.array([0x7FC00000, 0xFFC00000, 0x7F800001], dtype=np.uint32)
    assert (_round_host(hostlib, x, (scalar, scalar)) == scalar).all()


# ---- delta: encode / decode / apply, against the reference ----------------------------------


@pytest.mark.parametrize("width,order", CASES)
@CHECKED
@given(n=SIZES, density=DENSITY, seed=st.integers(0, 2**32 - 1))
def test_encode_decode_match_reference(host_kernels, width, order, n, density, seed):
    old, new = make_case(np.random.default_rng(seed), width, order, n, density)
    ref = delta_ref.encode(old, new, order)
    got = host_kernels.delta_encode(old, new, order)
    assert sections_equal(got, ref)
    pos, values = host_kernels.delta_decode(old, got, order)
    rpos, rvalues = delta_ref.decode(old, ref, order)
    assert pos.dtype == rpos.dtype and pos.tobytes() == rpos.tobytes()
    assert values.dtype == rvalues.dtype and values.tobytes() == rvalues.tobytes()


@pytest.mark.parametrize("width,order", [(2, "float"), (4, "float"), (1, "int"), (8, "uint")])
@CHECKED
@given(n=SIZES, density=DENSITY, seed=st.integers(0, 2**32 - 1))
def test_apply_in_place_and_undo(host_kernels, width, order, n, density, seed):
    old, new = make_case(np.random.default_rng(seed), width, order, n, density)
    sec = host_kernels.delta_encode(old, new, order)
    live = old.copy()
    undo = host_kernels.engine.apply(live, sec, order, undo=True)
    assert live.tobytes() == new.tobytes()
    host_kernels.engine.restore(live, undo)
    assert live.tobytes() == old.tobytes()
    assert host_kernels.engine.apply(live, sec, order, undo=False) is None
    assert live.tobytes() == new.tobytes()


def _corruptions(sec: delta_ref.DeltaSections, n: int, old: np.ndarray, order: str):
    """Sections that lie, each a different way (name, sections)."""
    def with_(**kw):
        parts = dict(table=sec.table.copy(), gaps=sec.gaps.copy(), steps=sec.steps.copy(), escapes=sec.escapes.copy())
        parts.update(kw)
        return delta_ref.DeltaSections(**parts)

    nc = delta_ref.nchunks(n)
    k = len(sec.gaps) // 2
    gaps = sec.gaps.copy()
    gaps[k] = 65535
    yield "gap past the chunk", with_(gaps=gaps)
    gaps = sec.gaps.copy()
    gaps[-1] = gaps[-1] + (n - 1) % 65536 + 1 if gaps[-1] < 60000 else 65535
    yield "last gap past the end", with_(gaps=gaps)
    # Exactly one past the chunk: the off-by-one a bounds check must not have.
    pos = delta_ref.decode(old, sec, order)[0]
    counts = sec.table[:nc].astype(np.int64)
    last_of_chunk = np.cumsum(counts) - 1
    for c in {0, nc - 1}:
        if counts[c]:
            i = int(last_of_chunk[c])
            room = int(cuda.chunk_lengths(n)[c]) - int(pos[i] - c * 65536)
            if int(sec.gaps[i]) + room <= 65535:
                gaps = sec.gaps.copy()
                gaps[i] += room
                yield f"change at the end of chunk {c}", with_(gaps=gaps)
    esc = np.flatnonzero(sec.steps == delta_ref.ESCAPE)
    plain = np.flatnonzero(sec.steps != delta_ref.ESCAPE)
    if len(esc):
        steps = sec.steps.copy()
        steps[esc[0]] = 1
        yield "escape marker removed", with_(steps=steps)
    if len(plain):
        steps = sec.steps.copy()
        steps[plain[0]] = delta_ref.ESCAPE
        yield "escape marker added", with_(steps=steps)
    table = sec.table.copy()
    table[0] += 1
    yield "count without a change", with_(table=table)
    table = sec.table.copy()
    table[0] = 70000
    yield "count over the chunk", with_(table=table)
    table = sec.table.copy()
    table[nc] = table[0] + 1
    yield "more escapes than changes", with_(table=table)
    yield "table too short", with_(table=sec.table[:-1])


@pytest.mark.parametrize("width,order", [(2, "float"), (4, "int"), (1, "uint")])
@pytest.mark.parametrize("n", [1000, 65536 * 2 + 300])
def test_bad_sections_raise_like_the_reference_and_touch_nothing(host_kernels, width, order, n):
    old, new = make_case(np.random.default_rng(n + width), width, order, n, 0.05)
    sec = delta_ref.encode(old, new, order)
    for what, bad in _corruptions(sec, n, old, order):
        with pytest.raises(FormatError) as ref_err:
            delta_ref.decode(old, bad, order)
        with pytest.raises(FormatError) as got_err:
            host_kernels.delta_decode(old, bad, order)
        assert str(got_err.value) == str(ref_err.value), what
        live = old.copy()
        with pytest.raises(FormatError):
            host_kernels.engine.apply(live, bad, order, undo=True)
        assert live.tobytes() == old.tobytes(), what


def test_bad_order_and_shapes_are_refused(host_kernels):
    a = np.zeros(10, np.uint16)
    with pytest.raises(ValueError, match="order"):
        host_kernels.delta_encode(a, a, "bfloat")
    with pytest.raises(ValueError, match="differ"):
        host_kernels.delta_encode(a, np.zeros(11, np.uint16), "float")


# ---- fused change detection from fp32 masters ---------------------------------------------------


@CHECKED
@given(n=SIZES, seed=st.integers(0, 2**32 - 1), lr=st.sampled_from([1e-6, 1e-4, 1e-2]))
def test_fused_detector_matches_reference_on_torch_casts(host_kernels, n, seed, lr):
    rng = np.random.default_rng(seed)
    before = (rng.standard_normal(n) * 0.02).astype(np.float32)
    specials = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7F800000, 0xFF800000, 0, 0x80000000, 1,
                         0x80000001, 0x3F808000, 0x3F818000, 0x00400000, 0x807F0000], dtype=np.uint32).view(np.float32)
    before[rng.random(n) < 0.01] = rng.choice(specials)
    with np.errstate(invalid="ignore"):  # inf + x may be NaN: that is one of the cases
        after = before + (rng.standard_normal(n) * lr).astype(np.float32)
    after[rng.random(n) < 0.001] = rng.choice(specials)  # NaN appears, disappears, changes payload
    nan = cuda.torch_bf16_nan_bits("cpu")
    got = host_kernels.engine.encode_bf16_from_f32(before.view(np.uint32), after.view(np.uint32), nan)
    b16 = torch.from_numpy(before).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    a16 = torch.from_numpy(after).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert sections_equal(cuda.sections_to_host(got, np.uint16), delta_ref.encode(b16, a16, "float"))


# ---- plumbing ------------------------------------------------------------------------------------


def test_kernel_source_is_self_contained():
    src = cuda.kernel_source()
    assert '#include "' not in src and "#pragma once" not in src
    for name in ("delta_count_u16_float", "delta_fill_u64_int", "delta_apply_u8_uint", "delta_restore_u32",
                 "delta_check", "fused_count_bf16", "fused_fill_bf16", "xxh3_blocks"):
        assert name in src or name.rsplit("_", 2)[0] in src


def test_without_a_gpu_the_backend_says_why():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        pytest.skip("a GPU is visible here")
    except ImportError:
        pass
    except Exception:
        pass
    with pytest.raises(cuda.BackendUnavailable, match=r"wsync\[cuda\]"):
        cuda.CudaKernels()


def test_whole_payloads_match_the_reference_backend(host_kernels, monkeypatch):
    """Through wsync.encode / apply_state, the host build is one more backend: same bytes as ref."""
    import wsync
    from wsync import backends
    from wsync.snapshot import as_state

    monkeypatch.setitem(backends._cache, "cuda-host", (host_kernels, backends.BackendInfo("cuda", "cuda-host", "test")))
    rng = np.random.default_rng(12)
    base, new = {}, {}
    for name, (w, o, dt) in {"w16": (2, "float", np.float16), "w32": (4, "float", np.float32),
                             "i8": (1, "int", np.int8), "dense": (2, "uint", np.uint16)}.items():
        b, n = make_case(rng, w, o, 140_001, 0.6 if name == "dense" else 0.01)
        base[name], new[name] = b.view(dt), n.view(dt)
    for tier in ("sparse", "packed"):
        ours = wsync.encode(base, new, tier=tier, backend="cuda-host")
        assert ours.to_bytes() == wsync.encode(base, new, tier=tier, backend="ref").to_bytes()
        got = wsync.apply_state(as_state(base), ours.to_bytes(), backend="cuda-host")
        assert all(got[k].bits.tobytes() == new[k].tobytes() for k in new)
