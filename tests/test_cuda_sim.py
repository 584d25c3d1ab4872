"""The CUDA kernels themselves, run on the CPU: byte for byte what wsync.codecs.delta_ref writes.

csrc/delta_cuda.cu is compiled unchanged by g++ after tests/cudasim/wsim.h
(one fiber per GPU thread, strict barriers and warp collectives, junk in
shared memory and in fresh device arrays) and driven by the real host side
of wsync.backends.cuda (_Launcher, _KernelsOver) through SimRuntime in place
of cupy. Every kernel runs under three schedules (random in the default run;
forward and reverse too in the slow tier), across widths, orders, sizes around
the 65,536-element chunk, densities from none to all, and misaligned views.
tests/test_cuda_kernels.py is the same check on a real GPU when one is lent.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from wsync.backends import cuda
from wsync.checksum import BLOCK, block_digests, checksum
from wsync.codecs import delta_ref
from wsync.errors import FormatError

cudasim = pytest.importorskip("cudasim")
from cudasim.cases import CASES, corruptions, make_case, misaligned, sections_equal  # noqa: E402

SCHEDULES = ("forward", "reverse", "random")
# the default run drives each case under the random schedule; the two ordered ones add the slow tier's
ORDERINGS = [s if s == "random" else pytest.param(s, marks=pytest.mark.slow) for s in SCHEDULES]
C = delta_ref.CHUNK_ELEMS
SMALL = (0, 1, 2, 31, 33, 257, 4097)
EDGES = (C - 1, C, C + 1, 2 * C + 4099)  # around one chunk, and a short third chunk
DENSITIES = (0.0, 0.001, 0.05, 0.3, 1.0)


def kernels_on(sim, schedule: str, seed: int = 0) -> cuda._KernelsOver:
    return cuda._KernelsOver(cudasim.SimRuntime(sim, schedule, seed))


def round_trip(k: cuda._KernelsOver, old, new, order: str, what: str) -> None:
    """encode, decode, apply with undo, restore, apply without: each byte for byte against delta_ref."""
    ref = delta_ref.encode(old, new, order)
    got = k.delta_encode(old, new, order)
    assert sections_equal(got, ref), f"encode, {what}"
    pos, values = k.delta_decode(old, got, order)
    rpos, rvalues = delta_ref.decode(old, ref, order)
    assert pos.dtype == rpos.dtype and pos.tobytes() == rpos.tobytes(), f"decode positions, {what}"
    assert values.dtype == rvalues.dtype and values.tobytes() == rvalues.tobytes(), f"decode values, {what}"
    live = np.array(old, copy=True)
    undo = k.launcher.apply(live, got, order, undo=True)
    assert live.tobytes() == new.tobytes(), f"apply, {what}"
    k.launcher.restore(live, undo)
    assert live.tobytes() == old.tobytes(), f"restore, {what}"
    assert k.launcher.apply(live, got, order, undo=False) is None
    assert live.tobytes() == new.tobytes(), f"apply without undo, {what}"


# ---- delta: every width and order, under every schedule --------------------------------------------


@pytest.mark.parametrize("schedule", ORDERINGS)
@pytest.mark.parametrize("width,order", CASES)
def test_small_sizes_every_density(sim, width, order, schedule):
    k = kernels_on(sim, schedule, seed=width)
    rng = np.random.default_rng(width * 10 + len(order))
    for n in SMALL:
        for density in (0.0, 0.5, 1.0):
            old, new = make_case(rng, width, order, n, density)
            round_trip(k, old, new, order, f"n={n} density={density}")


@pytest.mark.parametrize("schedule", ORDERINGS)
@pytest.mark.parametrize("width,order", CASES)
def test_chunk_edges(sim, width, order, schedule):
    """65,535 / 65,536 / 65,537 elements and a short third chunk; each combination meets four of the
    five densities (none, 0.1%, 5%, 30%, all) and each density meets every size across the table."""
    i = CASES.index((width, order))
    k = kernels_on(sim, schedule, seed=i)
    rng = np.random.default_rng(1000 + i)
    for j, n in enumerate(EDGES):
        density = DENSITIES[(i + j) % len(DENSITIES)]
        old, new = make_case(rng, width, order, n, density)
        round_trip(k, old, new, order, f"n={n} density={density}")


@pytest.mark.parametrize("schedule", ORDERINGS)
@pytest.mark.parametrize("width", (1, 2, 4, 8))
def test_misaligned_views(sim, width, schedule):
    """Host arrays at odd byte offsets (the engine copies them aligned); device weights at element
    offsets that are not 16-byte aligned (the walk kernels take them as they are)."""
    k = kernels_on(sim, schedule, seed=width)
    rng = np.random.default_rng(width)
    for offset in (1, 3, width, 8 + width % 8):
        n = 3000 + 7 * offset
        old, new = make_case(rng, width, "float", n, 0.1)
        mo, mn = misaligned(old, offset), misaligned(new, offset)
        assert sections_equal(k.delta_encode(mo, mn, "float"), delta_ref.encode(old, new, "float"))
        pos, values = k.delta_decode(mo, delta_ref.encode(old, new, "float"), "float")
        assert values.tobytes() == delta_ref.decode(old, delta_ref.encode(old, new, "float"), "float")[1].tobytes()
        if offset % width == 0:
            live = misaligned(old, offset)
            undo = k.launcher.apply(live, delta_ref.encode(old, new, "float"), "float", undo=True)
            assert live.tobytes() == new.tobytes()
            k.launcher.restore(live, undo)
            assert live.tobytes() == old.tobytes()


# ---- hostile sections ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ORDERINGS)
@pytest.mark.parametrize("width,order", [(2, "float"), (4, "int"), (1, "uint"), (8, "float")])
@pytest.mark.parametrize("n", [1000, 2 * C + 300])
def test_bad_sections_raise_like_the_reference_and_touch_nothing(sim, width, order, n, schedule):
    k = kernels_on(sim, schedule)
    old, new = make_case(np.random.default_rng(n + width), width, order, n, 0.05)
    sec = delta_ref.encode(old, new, order)
    for what, bad in corruptions(sec, n, old, order):
        with pytest.raises(FormatError) as ref_err:
            delta_ref.decode(old, bad, order)
        with pytest.raises(FormatError) as got_err:
            k.delta_decode(old, bad, order)
        assert str(got_err.value) == str(ref_err.value), what
        live = old.copy()
        with pytest.raises(FormatError) as apply_err:
            k.launcher.apply(live, bad, order, undo=True)
        assert str(apply_err.value) == str(ref_err.value), what
        assert live.tobytes() == old.tobytes(), what


def test_bad_order_and_shapes_are_refused(sim):
    k = kernels_on(sim, "forward")
    a = np.zeros(10, np.uint16)
    with pytest.raises(ValueError, match="order"):
        k.delta_encode(a, a, "bfloat")
    with pytest.raises(ValueError, match="differ"):
        k.delta_encode(a, np.zeros(11, np.uint16), "float")


# ---- xxh3 checksum blocks -------------------------------------------------------------------------------

XXH3_LENGTHS = list(range(0, 301)) + [
    511, 512, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 4096 + 63, 65536 + 3, 123_457]


@pytest.mark.parametrize("schedule", ORDERINGS)
def test_xxh3_every_length_class_matches_xxhash(sim, schedule):
    """One launch over ~330 buffers: each is one warp's block, hashed like python-xxhash hashes it."""
    k = kernels_on(sim, schedule)
    rng = np.random.default_rng(7)
    bufs = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in XXH3_LENGTHS]
    bufs += [misaligned(rng.integers(0, 256, size=n, dtype=np.uint8), 3) for n in (5, 300, 4099)]
    got = k.launcher.block_digests(bufs)
    for b, d in zip(bufs, got):
        want = [xxhash.xxh3_64_intdigest(b.tobytes())] if b.nbytes else []
        assert d.tolist() == want, f"{b.nbytes} bytes"


@pytest.mark.parametrize("schedule", ORDERINGS)
def test_block_digests_match_the_checksum_module(sim, schedule):
    k = kernels_on(sim, schedule)
    rng = np.random.default_rng(8)
    raw = rng.integers(0, 256, size=3 * BLOCK + 1000, dtype=np.uint8)
    bufs = [raw[: 3 * BLOCK + 17], raw[:0], raw[1:241], raw[5 : 5 + BLOCK], raw[: BLOCK + 1], raw[3:4],
            raw[BLOCK - 1 : 2 * BLOCK]]
    got = k.launcher.block_digests(bufs)
    for b, d in zip(bufs, got):
        assert d.tobytes() == block_digests(b).tobytes()
    assert k.launcher.digests(bufs) == [checksum(b) for b in bufs]
    assert k.checksum(raw) == checksum(raw)  # host bytes stay on the host


# ---- bf16 rounding and fused change detection -------------------------------------------------------------


def _round_torch(f32_bits: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(f32_bits, dtype=np.uint32).view(np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _round_device(sim, f32_bits: np.ndarray, nan_bits) -> np.ndarray:
    x = np.ascontiguousarray(f32_bits, dtype=np.uint32)
    out = np.empty(len(x), dtype=np.uint16)
    sim.launch("probe_bf16_rne", 64, 256, (x, out, np.uint64(len(x)), np.uint32(nan_bits[0]), np.uint32(nan_bits[1])))
    return out


def test_torch_maps_every_nan_to_one_pattern_per_sign():
    """The kernel's assumption: the NaN a cast yields depends on the sign at most, not the payload."""
    rng = np.random.default_rng(9)
    payload = rng.integers(1, 1 << 23, size=4096, dtype=np.uint32)
    pos = np.concatenate([[1, 0x400000, 0x7FFFFF, 0x3FFFFF], payload]).astype(np.uint32) | 0x7F800000  # sNaN and qNaN
    for sign, expect in zip((0, 0x80000000), cuda.torch_bf16_nan_bits("cpu")):
        got = _round_torch(pos | np.uint32(sign))
        assert (got == expect).all(), sorted(set(got.tolist()))


def test_bf16_rounding_matches_torch(sim):
    rng = np.random.default_rng(10)
    nan = cuda.torch_bf16_nan_bits("cpu")
    # Every sign/exponent/upper-mantissa pattern with the low halves where rounding decides.
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], dtype=np.uint32)
    grid = (hi[:, None] | lows[None, :]).reshape(-1)
    rand = rng.integers(0, 1 << 32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
                        0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF,
                        0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x3F808000, 0x3F818000, 0x3F7FFFFF], dtype=np.uint32)
    for x in (special, grid, rand):
        assert (_round_device(sim, x, nan) == _round_torch(x)).all()
    # torch's scalar CPU cast says 0x7FC0 for NaN; pass that and the kernel says it too.
    scalar = int(torch.tensor(float("nan")).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    assert (_round_device(sim, special[4:8], (scalar, scalar))[[0, 1, 2, 3]] == scalar).all()


@pytest.mark.parametrize("schedule", ORDERINGS)
@pytest.mark.parametrize("n,lr", [(1, 1e-2), (1000, 1e-6), (C + 1, 1e-4), (2 * C + 5, 1e-2)])
def test_fused_detector_matches_reference_on_torch_casts(sim, schedule, n, lr):
    k = kernels_on(sim, schedule)
    rng = np.random.default_rng(n)
    before = (rng.standard_normal(n) * 0.02).astype(np.float32)
    specials = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7F800000, 0xFF800000, 0, 0x80000000, 1,
                         0x80000001, 0x3F808000, 0x3F818000, 0x00400000, 0x807F0000], dtype=np.uint32).view(np.float32)
    before[rng.random(n) < 0.01] = rng.choice(specials)
    with np.errstate(invalid="ignore"):  # inf + x may be NaN: that is one of the cases
        after = before + (rng.standard_normal(n) * lr).astype(np.float32)
    after[rng.random(n) < 0.001] = rng.choice(specials)  # NaN appears, disappears, changes payload
    nan = cuda.torch_bf16_nan_bits("cpu")
    got = k.launcher.encode_bf16_from_f32(before.view(np.uint32), after.view(np.uint32), nan)
    b16 = _round_torch(before.view(np.uint32))
    a16 = _round_torch(after.view(np.uint32))
    assert sections_equal(cuda.sections_to_host(got, np.uint16), delta_ref.encode(b16, a16, "float"))


# ---- the whole backend ----------------------------------------------------------------------------------------


def test_whole_payloads_match_the_reference_backend(sim, monkeypatch):
    """Through wsync.encode / apply_state, the harness is one more backend: same bytes as ref."""
    import wsync
    from wsync import backends
    from wsync.snapshot import as_state

    k = kernels_on(sim, "random", seed=12)
    monkeypatch.setitem(backends._cache, "cuda-sim", (k, backends.BackendInfo("cuda", "cuda-sim", "test")))
    rng = np.random.default_rng(12)
    base, new = {}, {}
    for name, (w, o, dt) in {"w16": (2, "float", np.float16), "w32": (4, "float", np.float32),
                             "i8": (1, "int", np.int8), "dense": (2, "uint", np.uint16)}.items():
        b, n = make_case(rng, w, o, 140_001, 0.6 if name == "dense" else 0.01)
        base[name], new[name] = b.view(dt), n.view(dt)
    for tier in ("sparse", "packed", "v2"):  # v2: encoded by v2_ref (no CUDA encoder), decoded by the kernel
        ours = wsync.encode(base, new, tier=tier, backend="cuda-sim")
        assert ours.to_bytes() == wsync.encode(base, new, tier=tier, backend="ref").to_bytes()
        got = wsync.apply_state(as_state(base), ours.to_bytes(), backend="cuda-sim")
        assert all(got[name].bits.tobytes() == new[name].tobytes() for name in new)


def test_every_kernel_in_csrc_runs_under_three_schedules(sim):
    """Each __global__ entry point of csrc/*.cu is launched by the engine under each schedule.
    A kernel added to the source without a path here fails this test until it gets one."""
    in_source = {name for name in sim.kernels if not name.startswith("probe_")}
    for schedule in SCHEDULES:
        rt = cudasim.SimRuntime(sim, schedule, seed=5)
        k = cuda._KernelsOver(rt)
        rng = np.random.default_rng(5)
        for width, order in CASES:
            old, new = make_case(rng, width, order, 3000, 0.1)
            round_trip(k, old, new, order, f"width {width} {order}")
        before = rng.standard_normal(3000).astype(np.float32)
        k.launcher.encode_bf16_from_f32(before.view(np.uint32), (before * 1.001).view(np.uint32), (0x7FFF, 0x7FFF))
        k.launcher.digests([rng.integers(0, 256, 5000, dtype=np.uint8)])
        w = rng.integers(0, 1 << 16, (3, 70), dtype=np.uint16)
        k.launcher.lora_range(w, w ^ np.uint16(1), rng.standard_normal((70, 5)).astype(np.float32))
        from wsync.quant import Fp8Block, Int4Group, Int8Channel, ref as quant_ref  # csrc/ws_quant.cuh's kernels

        for dtype in quant_ref.FLOATS:
            q = quant_ref.round_to(rng.standard_normal((3, 130, 64)).astype(np.float32), dtype)
            for scheme in (Int4Group(32), Int8Channel(), Fp8Block()):
                want = scheme.reference(q, dtype)
                got = [np.empty_like(x) for x in want]
                k.quantize(scheme, q, dtype, got)
                assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want)), f"{scheme.kind} {dtype}"
        from codec_helpers import v2_round_trip  # delta v2's decoder (csrc/ws_v2_cuda.cu), one width each

        v2_round_trip(rt)
        assert in_source <= set(rt.launched), f"never launched under {schedule}: {sorted(in_source - set(rt.launched))}"
