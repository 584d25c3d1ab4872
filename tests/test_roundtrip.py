"""Bit-exact round trips of every codec and tier, compared as bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import examples

import wsync
from wsync.codecs import delta_ref
from wsync.dtypes import DTYPES

from conftest import bits_equal, states_equal

pytestmark = pytest.mark.usefixtures("each_backend")

NP_OF = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SPECIAL = {  # NaN, inf, -inf, -0.0, +0.0, smallest denormal, -denormal, max finite
    2: [0x7FC0, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x8001, 0x7F7F, 0xFFFF, 0x7C00],
    4: [0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 0, 1, 0x80000001, 0x7F7FFFFF, 0xFFFFFFFF],
    1: [0x7F, 0xFF, 0x80, 0x00, 0x01, 0x81, 0x7E],
    8: [0x7FF8000000000000, 0x8000000000000000, 0, 1, 0xFFFFFFFFFFFFFFFF],
}


def make_pair(rng, dtype: str, shape, density: float):
    """Base and new bit patterns whose changes mix tiny steps, sign crossings, huge jumps and specials."""
    dt = DTYPES[dtype]
    u = NP_OF[dt.itemsize]
    n = int(np.prod(shape, dtype=np.int64))
    info = np.iinfo(u)
    base = rng.integers(0, info.max, size=n, dtype=u, endpoint=True)
    sp = np.array(SPECIAL[dt.itemsize], dtype=u)
    base[rng.random(n) < 0.05] = rng.choice(sp)
    new = base.copy()
    changed = np.flatnonzero(rng.random(n) < density)
    how = rng.integers(0, 4, size=len(changed))
    k = delta_ref.monotone_key(base[changed], dt.order)
    small = (k + rng.integers(-3, 4, size=len(changed)).astype(u)).astype(u)
    new[changed] = np.where(how == 0, delta_ref.unkey(small, dt.order),
                   np.where(how == 1, rng.integers(0, info.max, size=len(changed), dtype=u, endpoint=True),
                   np.where(how == 2, rng.choice(sp, size=len(changed)), delta_ref.unkey(small, dt.order))))
    return base.view(dt.bits_dtype).reshape(shape), new.view(dt.bits_dtype).reshape(shape)


def to_numpy_dtype(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Views with a numpy dtype where one exists, else the bit patterns (the codec sees both the same)."""
    names = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64}
    return bits.view(names[dtype]) if dtype in names else bits


shapes = st.one_of(
    st.just(()),
    st.just((0,)),
    st.just((3, 0)),
    st.tuples(st.integers(1, 70_000)),
    st.tuples(st.integers(1, 300), st.integers(1, 300)),
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(["BF16", "F16", "F32", "F64", "F8_E4M3", "I8", "U8", "I16", "I32", "U32", "I64"]),
    shape=shapes,
    density=st.sampled_from([0.0, 1e-4, 0.01, 0.1, 0.5, 1.0]),
    tier=st.sampled_from(["sparse", "packed"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_delta_roundtrip_is_bit_exact(dtype, shape, density, tier, seed):
    rng = np.random.default_rng(seed)
    base_bits, new_bits = make_pair(rng, dtype, shape, density)
    if dtype in ("BF16", "F8_E4M3"):
        tdt = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}[dtype]
        base = {"w": torch.from_numpy(base_bits.copy()).view(tdt)}
        new = {"w": torch.from_numpy(new_bits.copy()).view(tdt)}
    else:
        base = {"w": to_numpy_dtype(base_bits, dtype)}
        new = {"w": to_numpy_dtype(new_bits, dtype)}
    payload = wsync.Payload.from_bytes(wsync.encode(base, new, tier=tier).to_bytes())
    out = wsync.apply(base, payload)
    assert states_equal(out, new)
    assert states_equal(base, {"w": base["w"]})  # out-of-place left base alone
    inplace = {"w": base["w"].copy() if isinstance(base["w"], np.ndarray) else base["w"].clone()}
    wsync.apply(inplace, payload, inplace=True)
    assert states_equal(inplace, new)


def test_every_bf16_pattern_to_every_neighbour():
    """All 65536 bf16 patterns, each moved by -2..2 keys and to a random pattern."""
    base = np.arange(65536, dtype=np.uint16)
    k = delta_ref.monotone_key(base, "float")
    rng = np.random.default_rng(0)
    for new in [delta_ref.unkey(k + np.uint16(s), "float") for s in (1, 2, 65535, 65534)] + [rng.permutation(base)]:
        for tier in ("sparse", "packed"):
            b, n = {"w": torch.from_numpy(base).view(torch.bfloat16)}, {"w": torch.from_numpy(new.copy()).view(torch.bfloat16)}
            assert states_equal(wsync.apply(b, wsync.encode(b, n, tier=tier)), n)


def test_sign_crossing_is_a_small_step():
    # +0.0 -> -0.0 and the smallest denormals around zero are one or two keys apart
    base = np.array([0x0000, 0x8000, 0x0001, 0x8001], dtype=np.uint16)
    new = np.array([0x8000, 0x0000, 0x8001, 0x0001], dtype=np.uint16)
    sec = delta_ref.encode(base, new, "float")
    assert sec.steps.tolist() == [-1, 1, -3, 3]
    assert len(sec.escapes) == 0


def test_raw_codec_needs_no_base():
    rng = np.random.default_rng(5)
    new = {"a": rng.standard_normal((17, 5)).astype(np.float32), "b": np.arange(10, dtype=np.int64)}
    payload = wsync.encode(None, new, codec="raw", version=7)
    assert payload.manifest.tier is None and payload.manifest.version == 7
    out = wsync.apply({"a": np.zeros((17, 5), np.float32), "b": np.zeros(10, np.int64)}, payload)
    assert states_equal(out, new)
    assert states_equal({k: v.numpy() for k, v in wsync.apply(None, payload.to_bytes()).items()}, new)


def test_unchanged_tensors_cost_nothing():
    base = {"w": torch.randn(1000).to(torch.bfloat16)}
    p = wsync.encode(base, {"w": base["w"].clone()})
    assert p.manifest.tensors[0].kind == "same" and len(p.body) == 0
    assert wsync.inspect(p)["changed"] == 0


def test_dense_change_falls_back_to_raw_or_xor():
    base = {"w": torch.randn(5000).to(torch.bfloat16)}
    new = {"w": (base["w"].float() * 1.5).to(torch.bfloat16)}
    assert wsync.encode(base, new, tier="sparse").manifest.tensors[0].kind == "raw"
    p = wsync.encode(base, new, tier="packed")
    assert p.manifest.tensors[0].kind == "xor"
    assert states_equal(wsync.apply(base, p), new)


def test_multi_chunk_positions():
    """Changes at both ends of every chunk, and a short last chunk."""
    n = 3 * 65536 + 5
    base = np.zeros(n, dtype=np.float32)
    new = base.copy()
    idx = [0, 65535, 65536, 131071, 131072, 196607, 196608, n - 1]
    new[idx] = 1.0
    for tier in ("sparse", "packed"):
        p = wsync.encode({"w": base}, {"w": new}, tier=tier)
        assert bits_equal(wsync.apply({"w": base}, p)["w"], new)
    sec = delta_ref.encode(base.view(np.uint32), new.view(np.uint32), "float")
    assert sec.table.tolist() == [2, 2, 2, 2] * 2  # 0.0 -> 1.0 is a huge step: every change escapes
    assert sec.gaps.tolist() == [0, 65534, 0, 65534, 0, 65534, 0, 3]


def test_torch_inplace_keeps_storage():
    m = torch.nn.Linear(64, 32).to(torch.bfloat16)
    base = {k: v.detach() for k, v in m.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in base.items()}
    new = {k: (v.float() + 0.01).to(torch.bfloat16) for k, v in base.items()}
    wsync.apply(base, wsync.encode(base, new), inplace=True)
    assert states_equal(base, new)
    assert {k: v.data_ptr() for k, v in base.items()} == ptrs
    assert torch.equal(m.weight.view(torch.uint16), new["weight"].view(torch.uint16))
