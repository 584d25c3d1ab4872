"""Bad input gets a specific WsyncError, says what and where, and changes nothing."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import wsync
from wsync.checksum import checksum
from wsync.codecs import delta_ref
from wsync.errors import ChecksumError, FormatError, MismatchError, VersionError, WsyncError
from wsync import api
from wsync.payload import HEADER, Payload

from helpers import clone, examples
from conftest import rewrite_manifest, states_equal

pytestmark = pytest.mark.usefixtures("each_backend")


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.weight": (torch.randn(300, 257, generator=g) * 0.02).to(torch.bfloat16),
        "layers.0.bias": torch.randn(257, generator=g).to(torch.bfloat16),
        "norm": torch.ones(257, dtype=torch.float32),
    }


def _step(state, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        mask = torch.rand(v.shape, generator=g) < 0.05
        out[k] = torch.where(mask, (v.float() * 1.01).to(v.dtype), v)
    return out


@pytest.fixture
def pair():
    base = _state()
    new = _step(base)
    return base, new


@pytest.fixture(params=["sparse", "packed"])
def blob(request, pair):
    base, new = pair
    return wsync.encode(base, new, tier=request.param, version=2, base_version=1).to_bytes()


def _refused(base, blob, err, match=None):
    """Both out-of-place and in-place apply raise err, and base keeps every byte."""
    before = clone(base)
    with pytest.raises(err, match=match):
        wsync.apply(base, blob)
    target = clone(base)
    with pytest.raises(err, match=match):
        wsync.apply(target, blob, inplace=True)
    assert states_equal(target, before)
    try:  # as a subscriber does: checked and unzipped on arrival (quietly), applied later
        prepared = api.prepare(Payload.from_bytes(blob))
    except WsyncError:
        prepared = None  # not even a payload: nothing to prepare
    if prepared is not None:
        with pytest.raises(err, match=match):
            wsync.apply(target, prepared, inplace=True)
        assert states_equal(target, before)
    assert states_equal(base, before)


@pytest.mark.parametrize("cut", [0, 10, HEADER.size, HEADER.size + 5, -1, -100])
def test_truncated(pair, blob, cut):
    _refused(pair[0], blob[:cut], FormatError, "truncated|too short|header")


def test_trailing_bytes(pair, blob):
    _refused(pair[0], blob + b"\0", FormatError, "trailing")


def test_flipped_body_byte(pair, blob):
    bad = bytearray(blob)
    bad[len(bad) - 7] ^= 0x10
    _refused(pair[0], bytes(bad), ChecksumError, "layers|norm")


def test_flipped_manifest_byte(pair, blob):
    bad = bytearray(blob)
    bad[HEADER.size + 20] ^= 0x01
    _refused(pair[0], bytes(bad), ChecksumError, "manifest")


def test_bad_magic(pair, blob):
    _refused(pair[0], b"GARBAGE!" + blob[8:], FormatError, "not a wsync payload")


def test_wrong_base(pair, blob):
    other = _step(pair[0], seed=99)
    _refused(other, blob, VersionError, "base version 1")


def test_delta_without_base(blob):
    with pytest.raises(VersionError, match="base is required"):
        wsync.apply(None, blob)


def test_unknown_codec(pair, blob):
    _refused(pair[0], rewrite_manifest(blob, lambda d: d.update(codec="zip")), FormatError, "unknown codec 'zip'")


def test_unknown_format_version(pair, blob):
    _refused(pair[0], rewrite_manifest(blob, lambda d: d.update(format_version=3)), FormatError, "format version 3")
    # a format 1 payload (wsync 0.1) is refused with a message naming the wsync that reads it
    _refused(pair[0], rewrite_manifest(blob, lambda d: d.update(format_version=1)), FormatError, "wsync 0.1")
    old = bytearray(blob)
    old[8] = 1
    _refused(pair[0], bytes(old), FormatError, "older wsync.*wsync 0.1")
    bad = bytearray(blob)
    bad[8] = 9
    _refused(pair[0], bytes(bad), FormatError, "format version 9")


def test_manifest_lies_about_shape(pair, blob):
    def grow(d):
        d["segments"][0]["shape"][0] += 257  # one row more than its layout holds

    _refused(pair[0], rewrite_manifest(blob, grow), (FormatError, MismatchError), "layers.0.weight")


def test_manifest_lies_about_part_length(pair, blob):
    def lie(d):
        t = d["segments"][0]
        t["parts"][1][1] += 4

    _refused(pair[0], rewrite_manifest(blob, lie), FormatError)


def test_manifest_lies_about_tiling(pair, blob):
    def lie(d):
        d["segments"][1]["offset"] += 1

    _refused(pair[0], rewrite_manifest(blob, lie), FormatError, "tile")


def test_manifest_bad_types(pair, blob):
    for mutate, match in [
        (lambda d: d["segments"][0].update(shape=[-1, 3]), "shape"),
        (lambda d: d["segments"][0].update(dtype="F128"), "unknown dtype"),
        (lambda d: d["segments"][0].update(checksum="xyz"), "hex"),
        (lambda d: d.update(segments={}), "segments"),
        (lambda d: d["segments"][0].update(offset=True), "offset"),
        (lambda d: d["segments"].append(d["segments"][0]), "twice"),
    ]:
        _refused(pair[0], rewrite_manifest(blob, mutate), FormatError, match)


def test_missing_and_extra_tensors(pair, blob):
    base = pair[0]
    fewer = {k: v for k, v in base.items() if k != "norm"}
    _refused(fewer, blob, MismatchError, "norm")
    more = dict(base, extra=torch.zeros(3))
    _refused(more, blob, MismatchError, "extra")
    with pytest.raises(MismatchError, match="norm"):
        wsync.encode(base, fewer)


def test_shape_and_dtype_mismatch(pair, blob):
    base = pair[0]
    _refused(dict(base, norm=torch.ones(256)), blob, MismatchError, r"norm.*F32\[257\].*F32\[256\]")
    _refused(dict(base, norm=torch.ones(257, dtype=torch.float16)), blob, MismatchError, "norm.*F16")
    with pytest.raises(MismatchError, match="norm"):
        wsync.encode(base, dict(pair[1], norm=torch.ones(3)))


def _forge_delta_body(blob: bytes, table_fn) -> bytes:
    """Rewrite the first tensor's sparse table with a lie, re-sealing its payload checksum."""
    _, _, mlen, _, _ = HEADER.unpack_from(blob)
    doc = json.loads(blob[HEADER.size : HEADER.size + mlen])
    t = doc["segments"][0]
    assert t["kind"] == "delta-sparse"
    body = bytearray(blob[HEADER.size + mlen :])
    tlen = t["parts"][0][1]
    table = np.frombuffer(bytes(body[:tlen]), "<u4").copy()
    table_fn(table)
    body[:tlen] = table.tobytes()
    t["payload_checksum"] = checksum(bytes(body[: sum(p[1] for p in t["parts"])]))
    m = json.dumps(doc).encode()
    return HEADER.pack(b"\x89WSYNC\r\n", 2, len(m), len(body), xxhash.xxh3_64_intdigest(m)) + m + bytes(body)


def test_sealed_lies_in_the_chunk_table(pair):
    base, new = pair
    blob = wsync.encode(base, new, tier="sparse").to_bytes()

    def more_changes(t):
        t[0] += 1

    def escapes_exceed(t):
        t[len(t) // 2] = t[0] + 1

    def too_many_for_chunk(t):
        t[0] = 70000

    for lie in (more_changes, escapes_exceed, too_many_for_chunk):
        _refused(base, _forge_delta_body(blob, lie), FormatError, "layers.0.weight")


def test_decoder_rejects_positions_outside_the_chunk():
    old = np.zeros(10, np.uint16)
    sec = delta_ref.DeltaSections(np.array([2, 0], "<u4"), np.array([3, 8], "<u2"), np.array([1, 1], np.int8), np.zeros(0, "<u2"))
    with pytest.raises(FormatError, match="offset 12 of chunk 0, which has 10"):
        delta_ref.decode(old, sec, "float")


def test_decoder_rejects_escape_marker_mismatch():
    old = np.zeros(10, np.uint16)
    sec = delta_ref.DeltaSections(np.array([1, 1], "<u4"), np.array([3], "<u2"), np.array([5], np.int8), np.zeros(1, "<u2"))
    with pytest.raises(FormatError, match="escape"):
        delta_ref.decode(old, sec, "float")


def test_wrong_result_checksum_rolls_back_every_tensor(pair):
    """The last tensor fails after the first two were written in place: all are restored."""
    base, new = pair
    blob = wsync.encode(base, new, tier="packed").to_bytes()

    def lie(d):
        d["segments"][-1]["checksum"] = "0123456789abcdef"

    _refused(base, rewrite_manifest(blob, lie), ChecksumError, "norm")


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data())
def test_random_corruption_never_escapes_as_anything_else(data):
    base = {"w": (torch.arange(2000, dtype=torch.float32) / 7).to(torch.bfloat16), "b": torch.arange(5, dtype=torch.int32)}
    new = {"w": (base["w"].float() * 1.003).to(torch.bfloat16), "b": torch.arange(5, dtype=torch.int32) * 2}
    tier = data.draw(st.sampled_from(["sparse", "packed"]))
    blob = bytearray(wsync.encode(base, new, tier=tier).to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    target = clone(base)
    try:
        out = wsync.apply(target, bytes(blob), inplace=True)
    except WsyncError:
        assert states_equal(target, base)
    else:  # the mutation changed nothing that matters (e.g. wrote the same byte)
        assert states_equal(out, new)
