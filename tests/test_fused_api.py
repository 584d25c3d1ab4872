"""wsync.api on the fused kernels keeps the contract of the unfused one, on every backend.

The fused path verifies each tensor's base while it applies it, so these pin
what could drift: which error wins when several things are wrong, that an
in-place apply refused at its last tensor puts back the first ones, that
tensors sharing memory (tied weights) are applied as if alone, and that
encode's checksums and bytes are the reference's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import wsync
from wsync import api
from wsync.checksum import checksum
from wsync.errors import ChecksumError, FormatError, VersionError
from wsync.layout import per_tensor

from helpers import clone
from conftest import rewrite_manifest, states_equal

pytestmark = pytest.mark.usefixtures("each_backend")


def _pair(n=3, size=70_000, seed=0):
    rng = np.random.default_rng(seed)
    base = {f"t{i}": rng.integers(0, 1 << 16, size=size, dtype=np.uint16) for i in range(n)}
    new = {}
    for name, b in base.items():
        w = b.copy()
        w[rng.random(size) < 0.01] += 1
        new[name] = w
    return base, new


def _enc(base, new, **kw):
    """One segment per tensor, so errors and checksums here are per tensor as these tests need."""
    members = per_tensor(api.as_state(new))
    return wsync.encode(base, new, members=members, **kw)


def _key(payload, name):
    return payload.manifest.members.keys()[payload.manifest.members.names.index(name)]


def _corrupt_frame(blob: bytes, payload, name: str) -> bytes:
    """Flip one body byte inside tensor `name`'s frame."""
    spec = payload.manifest.tensors_by_name[_key(payload, name)]
    b = bytearray(blob)
    b[len(blob) - len(payload.body) + spec.offset] ^= 0xFF
    return bytes(b)


def test_encode_checksums_are_the_references():
    base, new = _pair()
    p = _enc(base, new, tier="sparse")
    for name, spec in zip(p.manifest.members.names, p.manifest.tensors):
        assert spec.checksum == checksum(new[name])
        assert spec.base_checksum == checksum(base[name])
        assert spec.payload_checksum == checksum(bytes(p.frame(spec)))
    ref = _enc(base, new, tier="sparse", backend="ref")
    assert p.to_bytes() == ref.to_bytes()
    # one segment for all three: its checksums are those of the tensors back to back
    p = wsync.encode(base, new, tier="sparse")
    (spec,) = p.manifest.tensors
    assert spec.checksum == checksum(np.concatenate([new[n] for n in p.manifest.members.names]))
    assert spec.base_checksum == checksum(np.concatenate([base[n] for n in p.manifest.members.names]))
    ref = wsync.encode(base, new, tier="sparse", backend="ref")
    assert p.to_bytes() == ref.to_bytes()


def test_raw_keyframe_checksums():
    _, new = _pair(n=2)
    p = _enc(None, new, codec="raw")
    for name, spec in zip(p.manifest.members.names, p.manifest.tensors):
        assert spec.checksum == spec.payload_checksum == checksum(new[name])
    out = wsync.apply(None, p)  # torch tensors, since there is no base to take the flavour from
    assert all(out[n].numpy().tobytes() == new[n].tobytes() for n in new)


@pytest.mark.parametrize("inplace", [False, True])
def test_wrong_base_outranks_a_corrupt_earlier_frame(inplace):
    """t0's frame is corrupt and t2's base is wrong: VersionError, as if every base were checked first."""
    base, new = _pair()
    p = _enc(base, new, tier="sparse")
    blob = _corrupt_frame(p.to_bytes(), p, "t0")
    target = clone(base)
    target["t2"][5] ^= 1
    before = clone(target)
    with pytest.raises(VersionError, match="t2"):
        wsync.apply(target, blob, inplace=inplace)
    assert states_equal(target, before)
    with pytest.raises(VersionError, match="t2"):
        api.decode(api.as_state(target), wsync.payload.Payload.from_bytes(blob))


@pytest.mark.parametrize("inplace", [False, True])
def test_corrupt_frame_outranks_a_wrong_result(inplace):
    """t0's result checksum lies and t2's frame is corrupt: the frame's ChecksumError is the one raised."""
    base, new = _pair()
    blob = _enc(base, new, tier="sparse").to_bytes()

    def lie(doc):
        doc["segments"][0]["checksum"] = "0123456789abcdef"

    blob = rewrite_manifest(blob, lie)
    blob = _corrupt_frame(blob, wsync.payload.Payload.from_bytes(blob), "t2")
    target = clone(base)
    with pytest.raises(ChecksumError, match="t2: stored bytes"):
        wsync.apply(target, blob, inplace=inplace)
    assert states_equal(target, base)


def test_inplace_format_error_in_last_tensor_restores_the_first(monkeypatch):
    """t0 and t1 are written before t2's sections turn out bad: all three come back."""
    base, new = _pair()
    p = _enc(base, new, tier="sparse")
    target = clone(base)
    from wsync.codecs import delta

    real = delta._sparse_sections

    def lying(spec, parts, bits_dt):
        sec = real(spec, parts, bits_dt)
        if spec.name.endswith(":2"):
            sec.gaps = sec.gaps.copy()
            sec.gaps[-1] = 65535
        return sec

    monkeypatch.setattr(delta, "_sparse_sections", lying)
    with pytest.raises(FormatError, match="t2: change"):
        wsync.apply(target, p, inplace=True)
    assert states_equal(target, base)


@pytest.mark.parametrize("tier", ["sparse", "packed"])
def test_tied_tensors_in_place(tier):
    """Two names on one storage, changed alike: applied in place as if each were alone."""
    emb = (torch.randn(300, 64) * 0.02).to(torch.bfloat16)
    base = {"embed.weight": emb, "lm_head.weight": emb, "norm": torch.ones(64, dtype=torch.bfloat16)}
    moved = (emb.float() * 1.01).to(torch.bfloat16)
    new = {"embed.weight": moved, "lm_head.weight": moved, "norm": torch.ones(64, dtype=torch.bfloat16) * 2}
    p = wsync.encode({k: v.clone() for k, v in base.items()}, new, tier=tier)
    out = wsync.apply(base, p, inplace=True)
    assert out is base and base["embed.weight"].data_ptr() == base["lm_head.weight"].data_ptr()
    assert states_equal(base, new)


def test_tied_tensors_roll_back():
    emb = (torch.randn(300, 64) * 0.02).to(torch.bfloat16)
    base = {"a": emb, "b": emb, "c": torch.zeros(10, dtype=torch.bfloat16)}
    moved = (emb.float() * 1.01).to(torch.bfloat16)
    new = {"a": moved, "b": moved, "c": torch.ones(10, dtype=torch.bfloat16)}
    blob = wsync.encode({k: v.clone() for k, v in base.items()}, new, tier="sparse").to_bytes()

    def lie(doc):
        doc["segments"][-1]["checksum"] = "0123456789abcdef"

    before = emb.clone()
    with pytest.raises(ChecksumError, match="c"):
        wsync.apply(base, rewrite_manifest(blob, lie), inplace=True)
    assert torch.equal(emb.view(torch.int16), before.view(torch.int16))


def test_apply_state_matches_decode_and_scatter():
    base, new = _pair(seed=3)
    p = _enc(base, new, tier="packed")
    state = api.as_state(base)
    out = api.apply_state(state, p)
    for name, dec in zip(p.manifest.members.names, api.decode(state, p).values()):
        bits = base[name].copy()
        bits[dec.positions] = dec.values
        assert out[name].bits.tobytes() == bits.tobytes() == new[name].tobytes()
    assert states_equal(base, _pair(seed=3)[0])  # out of place never writes the base


@pytest.mark.parametrize("tier", ["sparse", "packed"])
def test_prepared_payload_applies_bit_exact_and_keeps_error_ranks(tier):
    """api.prepare (what a subscriber runs as a bucket arrives) changes what apply does, never what it yields."""
    base, new = _pair()
    blob = _enc(base, new, tier=tier).to_bytes()
    prepared = api.prepare(wsync.payload.Payload.from_bytes(blob))
    assert sorted(prepared.unpacked) == [_key(prepared, n) for n in ("t0", "t1", "t2")]
    target = clone(base)
    wsync.apply(target, prepared, inplace=True)
    assert all(target[n].tobytes() == new[n].tobytes() for n in new)

    # t2's frame is corrupt: prepare stops there quietly, apply raises it, and a wrong base still outranks it
    bad = _corrupt_frame(blob, prepared, "t2")
    prepared = api.prepare(wsync.payload.Payload.from_bytes(bad))
    assert sorted(prepared.unpacked) == [_key(prepared, n) for n in ("t0", "t1")]
    target = clone(base)
    with pytest.raises(ChecksumError, match="t2: stored bytes"):
        wsync.apply(target, prepared, inplace=True)
    assert states_equal(target, base)
    target["t1"][7] ^= 1
    before = clone(target)
    with pytest.raises(VersionError, match="t1"):
        wsync.apply(target, api.prepare(wsync.payload.Payload.from_bytes(bad)), inplace=True)
    assert states_equal(target, before)
