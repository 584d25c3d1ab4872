"""The CUDA backend on a real GPU: byte for byte what wsync.codecs.delta_ref writes.

tests/test_cuda_sim.py already runs the same kernels on CPU fibers (every
thread, shuffle and barrier, under several schedules); what only a GPU can
check is the hardware itself: vector loads, real concurrency, DLPack sharing
with torch, streams, and the bf16 cast of torch's CUDA kernels. Every test here
skips, with the reason, where no GPU is.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import examples

from wsync.checksum import BLOCK, checksum
from wsync.codecs import delta_ref
from wsync.errors import BackendUnavailable, FormatError

from cudasim.cases import CASES, corruptions as _corruptions, make_case, sections_equal

SIZES = st.one_of(
    st.integers(0, 300),
    st.sampled_from([65535, 65536, 65537, 2 * 65536 + 7, 3 * 65536]),
    st.integers(1, 150_000),
)
DENSITY = st.one_of(st.sampled_from([0.0, 1.0, 1e-4]), st.floats(0.0, 1.0))
CHECKED = settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _why_no_gpu() -> str | None:
    try:
        import cupy
    except ImportError as e:
        return f"cupy is not installed ({e}); pip install 'wsync[cuda]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # cudaErrorInsufficientDriver, cudaErrorNoDevice, ...
        return f"no usable CUDA device: {e}"
    return None if n else "no CUDA device"


NO_GPU = _why_no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=f"needs a GPU: {NO_GPU}")]
SIGNED = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
TORCH_OF = {(1, "float"): "float8_e4m3fn", (1, "int"): "int8", (1, "uint"): "uint8", (2, "float"): "bfloat16",
            (2, "int"): "int16", (2, "uint"): "uint16", (4, "float"): "float32", (4, "int"): "int32",
            (4, "uint"): "uint32", (8, "float"): "float64", (8, "int"): "int64", (8, "uint"): "uint64"}


@pytest.fixture(scope="module")
def kern():
    from wsync.backends.cuda import CudaKernels

    try:
        return CudaKernels()
    except BackendUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def torch_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (a CPU wheel?): the DLPack entry points need a CUDA torch")
    return torch


def to_cuda(torch, bits: np.ndarray, width: int, order: str):
    """Bit patterns as a CUDA tensor of the dtype they stand for (moved as signed ints, then viewed)."""
    t = torch.from_numpy(np.ascontiguousarray(bits).view(SIGNED[width])).cuda()
    return t.view(getattr(torch, TORCH_OF[(width, order)]))


def from_cuda(torch, t) -> np.ndarray:
    if t.numel() == 0:  # torch gives an empty tensor stride 0, which refuses the view to bytes
        return np.zeros(0, np.uint8)
    return t.contiguous().view(torch.uint8).cpu().numpy()


# ---- the Kernels protocol on numpy arrays ------------------------------------------------------


@pytest.mark.parametrize("width,order", CASES)
@CHECKED
@given(n=SIZES, density=DENSITY, seed=st.integers(0, 2**32 - 1))
def test_encode_decode_match_reference(kern, width, order, n, density, seed):
    old, new = make_case(np.random.default_rng(seed), width, order, n, density)
    ref = delta_ref.encode(old, new, order)
    got = kern.delta_encode(old, new, order)
    assert sections_equal(got, ref)
    pos, values = kern.delta_decode(old, got, order)
    rpos, rvalues = delta_ref.decode(old, ref, order)
    assert pos.tobytes() == rpos.tobytes() and values.tobytes() == rvalues.tobytes()
    assert values.dtype == rvalues.dtype and pos.dtype == rpos.dtype


@pytest.mark.parametrize("n", [1000, 65536 * 2 + 300])
def test_bad_sections_raise_like_the_reference(kern, n):
    old, new = make_case(np.random.default_rng(n), 2, "float", n, 0.05)
    sec = delta_ref.encode(old, new, "float")
    for what, bad in _corruptions(sec, n, old, "float"):
        with pytest.raises(FormatError) as ref_err:
            delta_ref.decode(old, bad, "float")
        with pytest.raises(FormatError) as got_err:
            kern.delta_decode(old, bad, "float")
        assert str(got_err.value) == str(ref_err.value), what


# ---- GPU-native entry points on torch tensors ----------------------------------------------------


@pytest.mark.parametrize("width,order", CASES)
@CHECKED
@given(n=SIZES, density=DENSITY, seed=st.integers(0, 2**32 - 1))
def test_device_encode_apply_restore_digest(kern, torch_cuda, width, order, n, density, seed):
    from wsync.backends.cuda import sections_to_host

    torch = torch_cuda
    old, new = make_case(np.random.default_rng(seed), width, order, n, density)
    told, tnew = to_cuda(torch, old, width, order), to_cuda(torch, new, width, order)
    sec = kern.encode_device(told, tnew, order)
    assert sections_equal(sections_to_host(sec, new.dtype), delta_ref.encode(old, new, order))
    live = to_cuda(torch, old, width, order)  # fresh, moved as signed ints: torch has few kernels for uint16/32/64
    undo = kern.apply_device(live, sec, order, undo=True)
    assert from_cuda(torch, live).tobytes() == new.tobytes()
    assert kern.digest_device(live) == checksum(new)
    kern.restore_device(live, undo)
    assert from_cuda(torch, live).tobytes() == old.tobytes()


def test_device_apply_refuses_bad_sections_and_touches_nothing(kern, torch_cuda):
    torch = torch_cuda
    n = 3 * 65536 + 11
    old, new = make_case(np.random.default_rng(3), 2, "float", n, 0.02)
    sec = delta_ref.encode(old, new, "float")
    live = to_cuda(torch, old, 2, "float")
    for what, bad in _corruptions(sec, n, old, "float"):
        with pytest.raises(FormatError):
            kern.apply_device(live, bad, "float")
        assert from_cuda(torch, live).tobytes() == old.tobytes(), what


def test_digests_of_odd_sizes_and_offsets(kern, torch_cuda):
    torch = torch_cuda
    raw = torch.randint(0, 256, (3 * BLOCK + 999,), dtype=torch.uint8, device="cuda")
    views = [raw, raw[:0], raw[1:241], raw[5 : 5 + BLOCK], raw[: BLOCK + 1], raw[3:4], raw[7 : 2 * BLOCK + 7]]
    expect = [checksum(v.cpu().numpy()) for v in views]
    assert [kern.digest_device(v) for v in views] == expect
    assert kern.digests_device(views) == expect
    import cupy

    assert kern.checksum(cupy.asarray(raw.cpu().numpy())) == expect[0]


# ---- fused change detection ---------------------------------------------------------------------


def test_torch_cuda_maps_every_nan_to_one_pattern_per_sign(torch_cuda):
    from wsync.backends.cuda import torch_bf16_nan_bits

    torch = torch_cuda
    rng = np.random.default_rng(9)
    payload = np.concatenate([[1, 0x400000, 0x7FFFFF], rng.integers(1, 1 << 23, 4096)]).astype(np.uint32)
    for sign, expect in zip((0, 0x80000000), torch_bf16_nan_bits("cuda:0")):
        bits = (payload | np.uint32(0x7F800000) | np.uint32(sign)).view(np.int32)
        got = torch.from_numpy(bits).cuda().view(torch.float32).to(torch.bfloat16).view(torch.int16)
        assert set((got.cpu().numpy().view(np.uint16)).tolist()) == {expect}


@CHECKED
@given(n=SIZES, seed=st.integers(0, 2**32 - 1), lr=st.sampled_from([1e-6, 1e-4, 1e-2]))
def test_fused_detector_matches_reference_on_torch_casts(kern, torch_cuda, n, seed, lr):
    from wsync.backends.cuda import sections_to_host

    torch = torch_cuda
    g = torch.Generator(device="cuda").manual_seed(seed)
    before = torch.randn(n, device="cuda", generator=g) * 0.02
    specials = torch.tensor([0x7FC00000, -0x00400000, 0x7F800001, -0x007EDCBB, 0x7F800000, -0x00800000, 0, 1,
                             0x3F808000, 0x3F818000, 0x00400000, -0x7F810000], dtype=torch.int32, device="cuda").view(torch.float32)
    pick = torch.randint(0, len(specials), (n,), device="cuda", generator=g)
    before = torch.where(torch.rand(n, device="cuda", generator=g) < 0.01, specials[pick], before)
    after = before + torch.randn(n, device="cuda", generator=g) * lr
    after = torch.where(torch.rand(n, device="cuda", generator=g) < 0.001, specials[pick.flip(0)], after)
    got = sections_to_host(kern.fused_change_detect(before, after), np.uint16)
    b16 = before.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    a16 = after.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    assert sections_equal(got, delta_ref.encode(b16, a16, "float"))


# ---- through the public API, once the registry names the backend ---------------------------------


def test_public_api_round_trip_on_cuda(kern):
    import wsync
    from wsync.backends import REGISTRY

    if "cuda" not in REGISTRY:
        pytest.skip("the cuda backend is not in wsync.backends.REGISTRY yet")
    rng = np.random.default_rng(11)
    base, new = {}, {}
    for name, (w, o) in {"w16": (2, "float"), "w32": (4, "float"), "i8": (1, "int")}.items():
        base[name], new[name] = make_case(rng, w, o, 200_001, 0.01)
    base = {k: v.view({1: np.int8, 2: np.float16, 4: np.float32}[v.dtype.itemsize]) for k, v in base.items()}
    new = {k: v.view(base[k].dtype) for k, v in new.items()}
    for tier in ("sparse", "packed"):
        ours = wsync.encode(base, new, tier=tier, backend="cuda")
        ref = wsync.encode(base, new, tier=tier, backend="ref")
        assert bytes(ours.to_bytes()) == bytes(ref.to_bytes())


# ---- delta v2: the chunks decoded on the GPU (csrc/ws_v2_cuda.cu) ----------------------------------------------


@pytest.mark.parametrize("name,n", [("BF16", 3 * 65536 + 4099), ("F32", 65536 + 1), ("I8", 5000), ("U64", 3000),
                                    ("F8_E5M2", 65536 - 1)])
def test_v2_decode_matches_reference(kern, name, n):
    from codec_helpers import delta_pair

    from wsync.codecs import v2_ref

    dt, old, new = delta_pair(name, n, np.random.default_rng(n), density=0.01)
    parts = v2_ref.encode(old, delta_ref.encode(old, new, dt.order), dt)
    got, want = kern.v2_decode(old, parts, dt), v2_ref.decode(old, parts, dt)
    assert all(getattr(got, f).tobytes() == getattr(want, f).tobytes() for f in ("table", "gaps", "steps", "escapes"))
    bad = {**parts, "pos": parts["pos"][:-1]}
    with pytest.raises(FormatError):
        kern.v2_decode(old, bad, dt)


def test_v2_decoded_on_the_device_applies_in_place(kern, torch_cuda):
    from codec_helpers import delta_pair

    from wsync.codecs import v2_ref

    torch = torch_cuda
    dt, old, new = delta_pair("BF16", 5 * 65536 + 17, np.random.default_rng(8), density=0.005)
    parts = v2_ref.encode(old, delta_ref.encode(old, new, dt.order), dt)
    live = to_cuda(torch, old, 2, "float")
    sec = kern.v2_decode_device(live, parts, dt)
    kern.apply_device(live, sec, "float")
    assert from_cuda(torch, live).tobytes() == new.tobytes()
