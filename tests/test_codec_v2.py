"""Delta tier v2: bit-exact for every dtype, pinned by a golden vector, and hostile input refused.

The reference (wsync/codecs/v2_ref.py) is the spec; the C++ twin, when built, must give the same bytes
(test_v2_cpu_twin_is_byte_identical) and decode what the reference wrote.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import wsync
from wsync import api, dtypes
from wsync.checksum import checksum
from wsync.codecs import delta_ref, v2_ref
from wsync.errors import FormatError, WsyncError
from wsync.payload import Payload
from wsync.snapshot import TensorBits

from codec_helpers import decodes_as_the_reference, delta_pair, twin_matches_reference
from conftest import bits_equal

GOLDEN = Path(__file__).parent / "golden"


def _roundtrip(dt, old, new):
    sec = delta_ref.encode(old, new, dt.order)
    parts = v2_ref.encode(old, sec, dt)
    back = v2_ref.decode(old, parts, dt)
    for f in ("table", "gaps", "steps", "escapes"):
        assert getattr(back, f).tobytes() == getattr(sec, f).tobytes(), f
    return parts


@pytest.mark.parametrize("name", sorted(dtypes.DTYPES))
def test_every_dtype_round_trips_bit_exact(name, rng):
    dt = dtypes.DTYPES[name]
    _roundtrip(*delta_pair(name, 70_001 if dt.itemsize <= 2 else 9_000, rng))


@pytest.mark.parametrize("n,where", [(40, [39]), (40, [0]), (65536, [65535]), (65537, [65535, 65536]),
                                     (131072, list(range(0, 131072, 4096)))])
def test_edges_round_trip(n, where):
    dt = dtypes.DTYPES["BF16"]
    old = (np.arange(n, dtype=np.uint32) * 2654435761 >> 16).astype(np.uint16)
    new = old.copy()
    new[where] += 1
    _roundtrip(dt, old, new)


def test_special_floats_round_trip():
    dt = dtypes.DTYPES["F32"]
    old = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38] * 50, np.float32).view("<u4")
    new = old.copy()
    new[::3] = np.array([np.nan, 0.0, -np.inf, 1.0] * 100, np.float32).view("<u4")[: len(new[::3])]
    _roundtrip(dt, old, new)


@pytest.mark.parametrize("name", ["BF16", "F32", "I8", "U64"])
def test_api_round_trip_in_place_and_out(name, rng):
    dt, old, new = delta_pair(name, 40_000, rng, density=0.005)
    shape = (len(old),)
    base = {"w": TensorBits(dt, shape, old.copy())}
    target = {"w": TensorBits(dt, shape, new)}
    p = wsync.encode(base, target, tier="v2")
    assert [s.kind for s in p.manifest.tensors] == ["delta-v2"]
    got = api.apply_state(base, p.to_bytes())
    assert bits_equal(got["w"].bits, new)
    assert bits_equal(base["w"].bits, old)  # out of place left the base alone


def test_v2_is_smaller_than_packed_on_rl_like_steps(rng):
    """The context model pays where the change rate follows the exponent: small values change more."""
    n = 1 << 18
    w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    ulp = np.abs(np.spacing(w.astype(np.float16).astype(np.float32)))
    with np.errstate(over="ignore", divide="ignore"):
        moved = rng.random(n) < np.clip(2e-6 / ulp, 0, 0.5)  # an lr-sized update changes small values more often
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    new[moved] = (old[moved].astype(np.int64) + rng.choice([1, -1], moved.sum())).astype(np.uint16)
    dt = dtypes.DTYPES["BF16"]
    base, target = {"w": TensorBits(dt, (n,), old)}, {"w": TensorBits(dt, (n,), new)}
    v2 = len(wsync.encode(base, target, tier="v2").body)
    packed = len(wsync.encode(base, target, tier="packed").body)
    assert v2 < 0.8 * packed


# --- golden -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden_states():
    sys.path.insert(0, str(GOLDEN))
    from make_golden import golden_states

    return golden_states()


def _backends():
    from wsync import backends
    from wsync.errors import BackendUnavailable

    out = ["ref"]
    try:
        backends.kernels("cpu")
        out.append("cpu")
    except BackendUnavailable:
        pass
    return out


@pytest.mark.parametrize("backend", _backends())
def test_golden_v2_segments_are_pinned(golden_states, backend):
    """The delta-v2 segments' bytes (the other kinds use zstd, whose bytes follow its version), from every
    backend: the golden bf16 segment is two tensors whose chunk crosses from one to the other."""
    base, new = golden_states
    got = wsync.encode(base, new, version=2, base_version=1, tier="v2", backend=backend)
    want = Payload.read(GOLDEN / "delta_v2.wsd")
    kinds = [s.kind for s in want.manifest.tensors]
    assert kinds.count("delta-v2") == 2
    for g, w in zip(got.manifest.tensors, want.manifest.tensors):
        assert (g.name, g.kind, g.checksum) == (w.name, w.kind, w.checksum)
        if w.kind == "delta-v2":
            assert g.parts == w.parts
            assert bytes(got.frame(g)) == bytes(want.frame(w))


@pytest.mark.parametrize("backend", _backends())
def test_golden_v2_file_applies(backend):
    from wsync.checkpoint import read_safetensors

    base, _ = read_safetensors(GOLDEN / "base.safetensors")
    new, _ = read_safetensors(GOLDEN / "new.safetensors")
    out = wsync.apply_state(base, Payload.read(GOLDEN / "delta_v2.wsd"), backend=backend)
    for k in new:
        assert bits_equal(out[k].bits, new[k].bits), k


def test_v1_tiers_still_decode():
    from wsync.checkpoint import read_safetensors

    base, _ = read_safetensors(GOLDEN / "base.safetensors")
    new, _ = read_safetensors(GOLDEN / "new.safetensors")
    for name in ("delta_sparse", "delta_packed"):
        out = wsync.apply_state(base, Payload.read(GOLDEN / f"{name}.wsd"))
        assert all(bits_equal(out[k].bits, new[k].bits) for k in new)


def test_layout_by_hand():
    """Two bf16 changes in one chunk, worked out from the spec."""
    dt = dtypes.DTYPES["BF16"]
    # classes (exponent fields): 1.0 -> 127, 2.0 -> 128, 0.5 -> 126
    # (five zeros after them, class 0, unchanged: a 5-element tensor is too small to be a delta at all)
    old = np.array([0x3F80, 0x4000, 0x3F00, 0x3F80, 0x3F80] + [0] * 5, dtype="<u2")
    new = np.array([0x3F80, 0x4001, 0x3F00, 0x3F7F, 0x3F80] + [0] * 5, dtype="<u2")
    parts = _roundtrip(dt, old, new)
    # K=2; classes 127..128; class 127: 3 elements, 1 change -> m = round(ln2 * 3) = 2, F: all on d=-1 (sym 6);
    # class 128: 1 element, 1 change -> m = round(ln2) = 1, F: all on d=+1 (sym 7)
    f127 = [0] * 6 + [4096] + [0] * 8
    f128 = [0] * 7 + [4096] + [0] * 7
    model = bytearray()
    for f in ([2, 127, 129, 2], f127, [1], f128):  # 129 takes two varint bytes
        for v in f:
            v2_ref.put_varint(model, v)
    assert parts["model"] == bytes(model)
    # class 127: ranks (offsets 0, 3, 4) -> the change is rank 1: gap 1 of r=3, m=2: q=0 -> '0', then 1 in
    # truncated binary over 2 values -> '1'; end mark, r=1: q=0 < 1 -> '1' then 1*2 >= 1 stops.
    # class 128: rank 0 of 1, m=1: '0', s=1 no bits; end mark r=0: no bits.
    # bits LSB first: 0,1,1,0 -> 0b0110
    assert parts["pos"] == bytes([0b0110])
    assert parts["index"] == bytes([1, len(parts["steps"])])
    assert len(parts["steps"]) == 4  # two certain symbols cost nothing: the final state alone


# --- hostile input ----------------------------------------------------------------------------

def _segment_parts(p: Payload) -> tuple:
    spec = p.manifest.tensors[0]
    return spec, {k: bytes(v) for k, v in p.parts(spec).items()}


def _reseal(p: Payload, parts: dict) -> bytes:
    """p with its first segment's parts replaced and its checksums made right again: only the lie remains."""
    spec = p.manifest.tensors[0]
    frame = b"".join(parts[k] for k in spec.parts)
    spec.parts = {k: len(parts[k]) for k in spec.parts}
    spec.payload_checksum = checksum(frame)
    return Payload(p.manifest, memoryview(frame)).to_bytes()


@pytest.fixture(scope="module")
def victim():
    rng = np.random.default_rng(7)
    dt, old, new = delta_pair("BF16", 70_000, rng, density=0.004)
    base = {"w": TensorBits(dt, (len(old),), old)}
    p = wsync.encode(base, {"w": TensorBits(dt, (len(old),), new)}, tier="v2", backend="ref")
    return dt, old, new, p.to_bytes()


def _apply_refused(dt, old, blob):
    """Apply, out of place and in place, must raise a WsyncError and leave every base byte as it was."""
    import torch

    with pytest.raises(WsyncError):
        api.apply_state({"w": TensorBits(dt, (len(old),), old.copy())}, blob)
    t = torch.from_numpy(old.view(np.int16).copy()).view(torch.bfloat16)
    with pytest.raises(WsyncError):
        api.apply({"w": t}, blob, inplace=True)
    assert t.view(torch.int16).numpy().view(np.uint16).tobytes() == old.tobytes()


def _mutations(parts: dict, rng):
    yield "empty model", {**parts, "model": b""}
    yield "model truncated", {**parts, "model": parts["model"][:-1]}
    yield "model extended", {**parts, "model": parts["model"] + b"\x00"}
    yield "K huge", {**parts, "model": b"\xff" * 9 + b"\x01" + parts["model"][1:]}
    yield "K off by one", {**parts, "model": bytes([parts["model"][0] ^ 1]) + parts["model"][1:]}
    yield "index truncated", {**parts, "index": parts["index"][:-1]}
    yield "index lies", {**parts, "index": bytes([parts["index"][0] ^ 1]) + parts["index"][1:]}
    yield "pos truncated", {**parts, "pos": parts["pos"][:-3]}
    yield "steps truncated", {**parts, "steps": parts["steps"][:-2]}
    yield "steps empty", {**parts, "steps": b""}
    for part in ("model", "index", "pos", "steps"):
        for _ in range(6):
            b = bytearray(parts[part])
            if not b:
                continue
            b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
            yield f"{part} bit flip", {**parts, part: bytes(b)}


def test_corrupt_parts_raise_format_errors_from_the_decoder(victim):
    """Every mutation of the v2 parts, decoded directly: FormatError or a result that differs, never a crash.
    (A flip can give other valid codes; the payload's checksums catch those.)"""
    dt, old, new, blob = victim
    spec, parts = _segment_parts(Payload.from_bytes(blob))
    rng = np.random.default_rng(3)
    for what, bad in _mutations(parts, rng):
        try:
            sec = v2_ref.decode(old, bad, dt)
        except FormatError:
            continue
        assert what.endswith("bit flip"), what
        # decoded into something valid: it must at least be well-formed v1 sections
        delta_ref.decode(old, sec, dt.order)


def test_corrupt_resealed_payloads_are_refused_and_the_base_untouched(victim):
    dt, old, new, blob = victim
    rng = np.random.default_rng(4)
    spec, parts = _segment_parts(Payload.from_bytes(blob))
    for what, bad in _mutations(parts, rng):
        _apply_refused(dt, old, _reseal(Payload.from_bytes(blob), bad))


def test_a_wrong_base_is_refused(victim):
    dt, old, new, blob = victim
    other = old.copy()
    other[123] ^= 1
    _apply_refused(dt, other, blob)


def test_truncated_payload_is_refused(victim):
    dt, old, new, blob = victim
    for cut in (1, 7, len(blob) // 2):
        with pytest.raises(WsyncError):
            api.apply_state({"w": TensorBits(dt, (len(old),), old.copy())}, blob[:-cut])


def test_a_dense_claim_is_refused_before_decoding():
    """K larger than a delta may hold (the encoder stores such a change whole) is refused at the model."""
    dt = dtypes.DTYPES["BF16"]
    old = np.zeros(1000, "<u2")
    model = bytearray()
    for v in (900, 0, 0):
        v2_ref.put_varint(model, v)
    with pytest.raises(FormatError, match="too dense"):
        v2_ref.decode(old, {"model": bytes(model), "index": b"\x00\x00", "pos": b"", "steps": b""}, dt)


def test_huge_golomb_runs_stay_bounded():
    """m = 1 for every class and a stream of zero bits claims a change per bit: refused once past K."""
    dt = dtypes.DTYPES["BF16"]
    n = 65536
    old = np.zeros(n, "<u2")  # all class 0
    model = bytearray()
    for v in (10, 0, 1, 1):
        v2_ref.put_varint(model, v)
    for f in [4096] + [0] * 14:
        v2_ref.put_varint(model, f)
    pos = bytes(4096)
    index = bytearray()
    v2_ref.put_varint(index, len(pos))
    v2_ref.put_varint(index, 4)
    with pytest.raises(FormatError, match="more changes"):
        v2_ref.decode(old, {"model": bytes(model), "index": bytes(index), "pos": pos,
                            "steps": (1 << 23).to_bytes(4, "little")}, dt)


def test_v2_cpu_twin_is_byte_identical(rng):
    from wsync import backends
    from wsync.errors import BackendUnavailable

    try:
        k = backends.kernels("cpu")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    for name in sorted(dtypes.DTYPES):
        dt = dtypes.DTYPES[name]
        _, old, new = delta_pair(name, 70_001 if dt.itemsize <= 2 else 9_000, rng)
        twin_matches_reference(k, dt, old, new, name)


def test_cpu_twin_refuses_what_the_reference_refuses(victim):
    """Each mutation, decoded by both: the same error-or-result (the messages may differ)."""
    from wsync import backends
    from wsync.errors import BackendUnavailable

    try:
        k = backends.kernels("cpu")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    dt, old, new, blob = victim
    spec, parts = _segment_parts(Payload.from_bytes(blob))
    for what, bad in _mutations(parts, np.random.default_rng(5)):
        decodes_as_the_reference(k, old, bad, dt, what)


@pytest.mark.parametrize("tail", [1, 2, 3, 5, 6, 9, 4099])
def test_cpu_twin_decodes_a_short_last_chunk(tail):
    """A last chunk of 1, 2 or 5 elements leaves a quarter of it empty while an earlier one is short: the
    walkers must not read past the chunk into stale scratch, which refuses valid payloads."""
    from wsync import backends
    from wsync.errors import BackendUnavailable

    try:
        k = backends.kernels("cpu")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    for seed in range(3):  # the chunk before it leaves its classes in the thread's scratch
        dt, old, new = delta_pair("BF16", 3 * 65536 + tail, np.random.default_rng(seed), density=0.01)
        new[-tail:] = old[-tail:] ^ np.uint16(1)
        twin_matches_reference(k, dt, old, new, (tail, seed))


@pytest.mark.parametrize("backend", _backends())
def test_many_tensor_segment_round_trips(backend, rng):
    """Twenty bf16 tensors of odd sizes form one segment whose chunks run across tensors (a Table base)."""
    dt = dtypes.DTYPES["BF16"]
    sizes = [int(x) for x in rng.integers(1, 30_000, 20)]
    base, target = {}, {}
    for i, n in enumerate(sizes):
        _, old, new = delta_pair("BF16", n, rng, density=0.01)
        base[f"t{i}"], target[f"t{i}"] = TensorBits(dt, (n,), old), TensorBits(dt, (n,), new)
    p = wsync.encode(base, target, tier="v2", backend=backend)
    ref = wsync.encode(base, target, tier="v2", backend="ref")
    assert p.to_bytes() == ref.to_bytes()
    out = api.apply_state(base, p.to_bytes(), backend=backend)
    assert all(bits_equal(out[k].bits, target[k].bits) for k in target)
