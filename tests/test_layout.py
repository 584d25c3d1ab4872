"""Format 2: segments and the member table (layout.py) at the scale of MoE states, and what a crafted one gets."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import wsync
from wsync import api
from wsync.errors import ChecksumError, FormatError, MismatchError, VersionError
from wsync.layout import Layout, bind, per_tensor, layout_of
from wsync.payload import Payload

from helpers import clone
from conftest import rewrite_manifest, states_equal

pytestmark = pytest.mark.usefixtures("each_backend")

DTYPES = (np.uint16, np.float32, np.int64, np.uint8, np.float16)


def _many(n=3000, seed=0):
    """n tensors of uneven sizes (0 to 3,000 elements) over five dtypes, and a step of ~1% of their elements."""
    rng = np.random.default_rng(seed)
    base, new = {}, {}
    for i in range(n):
        dt = DTYPES[i % len(DTYPES)]
        size = int(rng.integers(0, 3000)) if i % 97 else 0
        b = (rng.integers(0, 200, size=size)).astype(dt)
        w = b.copy()
        idx = rng.random(size) < 0.01
        w[idx] = (w[idx] + 1).astype(dt)
        base[f"model.layers.{i // 300}.mlp.experts.{i % 300}.w"] = b.reshape(-1, 1) if i % 5 == 1 else b
        new[f"model.layers.{i // 300}.mlp.experts.{i % 300}.w"] = w.reshape(-1, 1) if i % 5 == 1 else w
    return base, new


@pytest.mark.parametrize("tier", ["sparse", "packed"])
def test_many_tensors_round_trip_exact(tier):
    base, new = _many()
    p = wsync.encode(base, new, tier=tier)
    assert len(p.manifest.tensors) == len(DTYPES)  # one segment per dtype, not one entry per tensor
    out = wsync.apply(base, p.to_bytes())
    assert all(out[k].tobytes() == new[k].tobytes() and out[k].shape == new[k].shape for k in new)
    target = clone(base)
    wsync.apply(target, p, inplace=True)
    assert states_equal(target, new)
    bound_target = clone(base)
    bound = bind(bound_target)
    wsync.apply(bound, p, inplace=True)  # its tables are built once and written through
    assert states_equal(bound_target, new)


def test_delta_by_hash_needs_the_layout():
    base, new = _many(500)
    members = layout_of(api.as_state(new))
    p = wsync.encode(base, new, members=members, inline=False)
    assert p.manifest.members is None and p.manifest.layout_hash == members.hash
    target = clone(base)
    with pytest.raises(MismatchError, match="keyframe"):
        wsync.apply(target, p.to_bytes(), inplace=True)
    assert states_equal(target, base)
    other = per_tensor(api.as_state(new))  # same tensors, another cut: another hash, never a wrong apply
    with pytest.raises(MismatchError, match=members.hash):
        wsync.apply(target, p, inplace=True, layouts={other.hash: other})
    wsync.apply(target, p, inplace=True, layouts={members.hash: members})
    assert states_equal(target, new)


def test_a_layout_that_does_not_fit_the_segments_is_refused():
    base, new = _many(200)
    members = layout_of(api.as_state(new))
    p = wsync.encode(base, new, members=members, inline=False)
    swapped = Layout(members.names, members.shapes, members.counts[::-1], members.dtypes[::-1])
    p.manifest.layout_hash = swapped.hash  # as if a sender named another table whose segments differ
    for s, key in zip(p.manifest.tensors, swapped.keys()):
        s.name = key
    with pytest.raises(FormatError, match="layout says"):
        wsync.apply(clone(base), Payload.from_bytes(p.to_bytes()), layouts={swapped.hash: swapped})


def _crafted(blob, mutate):
    return rewrite_manifest(blob, lambda d: mutate(d["members"]))


@pytest.mark.parametrize("mutate,match", [
    (lambda m: m["names"].__setitem__(1, m["names"][0]), "twice"),
    (lambda m: m["counts"].__setitem__(0, m["counts"][0] + 1), "add up"),
    (lambda m: m["shapes"].__setitem__(0, [-1]), "non-negative"),
    (lambda m: m["names"].__setitem__(0, 7), "non-empty strings"),
    (lambda m: m.update(names=m["names"] * 2000), "names"),
    (lambda m: m["dtypes"].__setitem__(0, "F128"), "dtype"),
    (lambda m: m["shapes"].__setitem__(0, [1 << 40, 1 << 40]), "more than"),
])
def test_crafted_member_tables_get_format_errors(mutate, match):
    base, new = _many(60)
    blob = wsync.encode(base, new).to_bytes()
    target = clone(base)
    with pytest.raises(FormatError, match=match):
        wsync.apply(target, _crafted(blob, mutate), inplace=True)
    assert states_equal(target, base)


def test_huge_declared_segment_allocates_nothing():
    base, new = _many(60)
    blob = wsync.encode(None, new, codec="raw").to_bytes()

    def lie(d):
        d["segments"][0]["shape"] = [1 << 50]
    with pytest.raises(FormatError):
        wsync.apply(None, rewrite_manifest(blob, lie))


def test_corrupt_many_tensor_payload_names_the_segment_and_leaves_base():
    base, new = _many(1000)
    p = wsync.encode(base, new, tier="packed")
    blob = bytearray(p.to_bytes())
    blob[len(blob) - len(p.body) + 5] ^= 0xFF
    target = clone(base)
    with pytest.raises(ChecksumError, match=r"the \d+ U16 tensors 'model\.layers\.0"):
        wsync.apply(target, bytes(blob), inplace=True)
    assert states_equal(target, base)
    other = clone(base)  # a wrong base outranks the corrupt payload, as ever
    first = [k for k, v in other.items() if v.size][0]
    other[first].reshape(-1)[0] += 1
    with pytest.raises(VersionError):
        wsync.apply(other, bytes(blob), inplace=True)


def test_manifest_of_a_dense_delta_is_small():
    """A 102-tensor dense model, 0.4% changed: the per-version manifest (layout by hash) is <= 2% of the payload."""
    from wsync_bench.many import manifest_share

    got = manifest_share()
    assert got["tensors"] == 102
    assert got["by_hash"]["share"] <= 0.02
    assert got["inline"]["manifest_bytes"] > got["by_hash"]["manifest_bytes"]


def test_per_tensor_layout_names_each_tensor():
    base, new = _many(40)
    members = per_tensor(api.as_state(new))
    p = wsync.encode(base, new, members=members)
    assert len(p.manifest.tensors) == 40
    assert json.loads(p.manifest.to_json())["members"]["counts"] == [1] * 40


def test_torch_moe_state_bound_once_and_published_many_versions():
    """A Bound of torch tensors: its tables point at the live memory, so later versions need no rebinding."""
    torch.manual_seed(0)
    live = {f"e.{i}": torch.randn(64).to(torch.bfloat16) for i in range(2000)}
    bound = bind(live)
    engine = {k: v.clone() for k, v in live.items()}
    prev = {k: v.clone() for k, v in live.items()}
    members = layout_of(bound)  # once: the Bound keeps its segment tables for this layout
    for _ in range(3):
        with torch.no_grad():
            for t in list(live.values())[::7]:
                t.view(torch.int16)[:3] += 1
        p = wsync.encode(wsync.bind(prev), bound, members=members, inline=False)
        wsync.apply(engine, p, inplace=True, layouts={members.hash: members})
        assert all(torch.equal(engine[k].view(torch.int16), live[k].view(torch.int16)) for k in live)
        prev = {k: v.clone() for k, v in live.items()}


def test_a_consistent_lie_about_member_shapes_is_refused():
    """The table is re-hashed and the segments renamed to match: its element counts still disagree with them."""
    base, new = _many(60)
    blob = wsync.encode(base, new).to_bytes()

    def lie(d):
        d["members"]["shapes"][0] = [1 << 20, 1 << 10]
        h = Layout.from_doc(d["members"]).hash
        d["layout_hash"] = h
        for j, s in enumerate(d["segments"]):
            s["name"] = f"{h}:{j}"
    target = clone(base)
    with pytest.raises(FormatError, match="layout says"):
        wsync.apply(target, rewrite_manifest(blob, lie), inplace=True)
    assert states_equal(target, base)
