"""The message header every transport sends (wsync.transports.envelope): round trips and refusals of bad bytes."""
from __future__ import annotations

import json

import pytest
import xxhash

from wsync.errors import ChecksumError, TransportError
from wsync.transports import envelope
from wsync.transports.envelope import MAX_BLOB, MAX_BLOBS, MAX_HEADER, PREFIX

LOCAL = dict(need=("sums", "piece"), may=("seg", "device", "ipc", "msg"))
DIGEST = "0123456789abcdef"


def _doc(**fields) -> bytes:
    return envelope.seal(json.dumps({"kind": "bucket", "meta": {}, "sizes": [3], **fields}).encode())


def test_round_trip_of_every_field():
    meta = {"version": 7, "names": ["a", "é"], "nested": {"x": [1.5, None, True]}}
    raw = envelope.pack("bucket", meta, [0, 5, 1 << 20], frame=64 << 10)
    h = envelope.parse(raw, need=("frame",))
    assert (h.kind, h.meta, h.sizes, h.frame, h.device) == ("bucket", meta, [0, 5, 1 << 20], 64 << 10, [])
    raw = envelope.pack("k", {}, [4, 8], chunk=3, device=[1])
    h = envelope.parse(raw, need=("chunk",), may=("device",))
    assert (h.chunk, h.device) == (3, [1])
    sums = [[DIGEST] * 3, [], []]
    raw = envelope.pack("m", {}, [9, 4, 0], sums=sums, piece=4, seg=2, device=[1], ipc=[{"h": "00"}], msg=5)
    h = envelope.parse(raw, **LOCAL)
    assert (h.sums, h.piece, h.seg, h.device, h.ipc, h.msg) == (sums, 4, 2, [1], [{"h": "00"}], 5)


def test_pack_leaves_out_empty_device_lists_and_none_fields():
    raw = envelope.pack("k", {}, [1], chunk=8, device=[], seg=None)
    assert b'"device"' not in raw and b'"seg"' not in raw
    with pytest.raises(TypeError):
        envelope.pack("k", {}, [1], colour=3)
    with pytest.raises(TypeError):
        envelope.pack("k", {"x": object()}, [1])


def test_every_truncation_is_refused():
    raw = envelope.pack("bucket", {"v": 1}, [3, 4], chunk=16)
    for n in range(len(raw)):
        with pytest.raises(TransportError):
            envelope.parse(raw[:n], need=("chunk",))
    with pytest.raises(TransportError, match="declares"):
        envelope.parse(raw + b"x", need=("chunk",))


def test_damage_is_a_checksum_error_and_a_foreign_frame_is_not_a_message():
    raw = bytearray(envelope.pack("bucket", {}, [3], chunk=16))
    raw[-2] ^= 1
    with pytest.raises(ChecksumError, match="checksum"):
        envelope.parse(bytes(raw), need=("chunk",))
    with pytest.raises(TransportError, match="not a wsync message"):
        envelope.parse(b"NOPE" + bytes(raw[4:]), need=("chunk",))


def test_announced_lengths_are_bounded_before_a_buffer_is_made():
    assert envelope.check_length(PREFIX.size + 1) == PREFIX.size + 1
    for n in (0, PREFIX.size, PREFIX.size + MAX_HEADER + 1, 1 << 40, -1):
        with pytest.raises(TransportError, match="limit"):
            envelope.check_length(n)
    lie = PREFIX.pack(envelope.MAGIC, MAX_HEADER + 1, 0)
    with pytest.raises(TransportError, match="limit"):
        envelope.parse(lie)


@pytest.mark.parametrize("sizes", [[MAX_BLOB + 1], [-1], [1.5], ["3"], [True], "3", {"0": 3}, None])
def test_oversize_or_mistyped_blob_sizes_are_refused(sizes):
    raw = envelope.seal(json.dumps({"kind": "k", "meta": {}, "sizes": sizes}).encode())
    with pytest.raises(TransportError, match="sizes"):
        envelope.parse(raw)


def test_crafted_huge_counts_are_refused():
    with pytest.raises(TransportError, match="at most"):
        envelope.parse(envelope.pack("k", {}, [0] * (MAX_BLOBS + 1)))
    assert len(envelope.parse(envelope.pack("k", {}, [0] * MAX_BLOBS)).sizes) == MAX_BLOBS
    # a digest count that would make the receiver cut a 1 TiB blob into 1-byte pieces before comparing
    with pytest.raises(TransportError, match="digests"):
        envelope.parse(envelope.pack("m", {}, [MAX_BLOB], sums=[[DIGEST]], piece=1), **LOCAL)
    with pytest.raises(TransportError, match="integer|outside"):
        envelope.parse(_doc(chunk=10 ** 30), need=("chunk",))
    with pytest.raises(TransportError, match="malformed"):  # more digits than Python turns into an int
        envelope.parse(envelope.seal(b'{"kind":"k","meta":{},"sizes":[' + b"9" * 5000 + b"]}"))


@pytest.mark.parametrize("kind", ["", "k" * (envelope.MAX_KIND + 1), 3, None, ["bucket"]])
def test_bad_kinds_are_refused(kind):
    raw = envelope.seal(json.dumps({"kind": kind, "meta": {}, "sizes": []}).encode())
    with pytest.raises(TransportError, match="kind"):
        envelope.parse(raw)


@pytest.mark.parametrize("body, match", [
    (b'{"kind":"k","meta":{},"sizes":[]', "malformed"),  # cut short
    (b'{"kind":"k","meta":{}, "sizes":[],}', "malformed"),
    (b"\xff\xfe", "malformed"),
    (b'["k", {}, []]', "not a JSON object"),
    (b'{"kind":"k","meta":[],"sizes":[]}', "meta"),
    (b'{"kind":"k","meta":"x","sizes":[]}', "meta"),
    (b'{"kind":"k","sizes":[]}', "missing meta"),
    (b'{"kind":"k","meta":' + b"[" * 5000 + b"]" * 5000 + b',"sizes":[]}', "nests deeper"),
])
def test_bad_meta_and_json_are_refused(body, match):
    with pytest.raises(TransportError, match=match):
        envelope.parse(envelope.seal(body))


def test_fields_are_only_those_the_transport_names():
    with pytest.raises(TransportError, match="missing frame"):
        envelope.parse(envelope.pack("k", {}, [1]), need=("frame",))
    with pytest.raises(TransportError, match="unexpected field 'chunk'"):
        envelope.parse(envelope.pack("k", {}, [1], frame=1 << 20, chunk=4), need=("frame",), may=("device",))


@pytest.mark.parametrize("fields, match", [
    (dict(frame=3), "frame size"),
    (dict(frame=envelope.MAX_FRAME + 1), "frame size"),
    (dict(frame="65536"), "frame size"),
    (dict(chunk=0), "chunk size"),
    (dict(chunk=1 << 40), "chunk size"),
    (dict(piece=0, sums=[[]]), "piece size"),
    (dict(device=[1]), "device blobs"),
    (dict(device=[0, 0]), "device blobs"),
    (dict(sums=[[DIGEST], [DIGEST]]), "digests of every blob"),
    (dict(sums=[["abc"]]), "digests"),
    (dict(sums=[[DIGEST, DIGEST]]), "digests"),
    (dict(sums=[[DIGEST]], device=[0]), "digests"),
    (dict(sums=[[DIGEST]], piece=2), "digests"),
    (dict(seg=-1), "segment id"),
    (dict(msg=0), "message id"),
    (dict(device=[0], ipc=[]), "ipc"),
    (dict(device=[0], ipc=["handle"]), "ipc"),
    (dict(device=[0]), "ipc descriptions"),
])
def test_bad_fields_are_refused(fields, match):
    may = ("frame", "chunk", "device", "sums", "piece", "seg", "msg", "ipc")
    with pytest.raises(TransportError, match=match):
        envelope.parse(_doc(**fields), may=may)


def test_header_checksum_covers_the_json_only():
    body = json.dumps({"kind": "k", "meta": {}, "sizes": []}).encode()
    raw = envelope.seal(body)
    assert raw[:4] == envelope.MAGIC and raw[PREFIX.size:] == body
    assert PREFIX.unpack_from(raw)[1:] == (len(body), xxhash.xxh3_64_intdigest(body))
