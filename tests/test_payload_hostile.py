"""Crafted payloads: declared sizes and nesting that lie.

A bomb here is a small, well-sealed payload whose manifest or zstd headers
declare far more than it holds. Each is opened in a child process, which
reports its peak RSS after every step: reading, inspecting, preparing (as a
subscriber does on arrival) and applying to a small base must each raise a
WsyncError (prepare: return quietly) while the peak grows by little, and the
base keeps every byte. The child also runs under an address-space limit, so
a regression fails with MemoryError rather than take the machine's memory.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xxhash
import zstandard

import wsync
from wsync import api
from wsync.checksum import checksum
from wsync.errors import FormatError
from wsync.layout import Layout
from wsync.manifest import Manifest, TensorSpec
from wsync.payload import HEADER, MAGIC, Payload

from conftest import rewrite_manifest

GROWTH_LIMIT = 96 << 20  # bytes of peak RSS a refused payload may cost (ru_maxrss is in KiB on Linux)
HEX = "0123456789abcdef"


def _rle_frame(size: int, byte: int = 0) -> bytes:
    """A valid zstd frame of `size` copies of one byte, in 4 bytes per 128 KiB: zstd's densest encoding.

    Its window is 128 KiB (as a streaming compressor's would be), so a stream reader accepts it too."""
    out = struct.pack("<IBB", 0xFD2FB528, 0xC0, (17 - 10) << 3) + struct.pack("<Q", size)  # 8-byte content size
    block = 128 << 10
    for at in range(0, size, block):
        n = min(block, size - at)
        last = at + n >= size
        out += (int(last) | (1 << 1) | (n << 3)).to_bytes(3, "little") + bytes([byte])
    return out


def _forge(segments: list[dict], *, codec: str = "delta", tier: str | None = "packed") -> bytes:
    """A sealed payload from hand-made segments: {name, dtype, numel, kind, parts: {section: bytes}}.

    Every checksum a receiver verifies before decoding is right, so only the declared sizes lie."""
    members = Layout(tuple(s["name"] for s in segments), tuple((s["numel"],) for s in segments),
                      (1,) * len(segments), tuple(s["dtype"] for s in segments))
    specs, body, offset = [], b"", 0
    for key, s in zip(members.keys(), segments):
        frame = b"".join(s["parts"].values())
        specs.append(TensorSpec(name=key, dtype=s["dtype"], shape=(s["numel"],), kind=s["kind"], offset=offset,
                                parts={p: len(v) for p, v in s["parts"].items()}, checksum=HEX,
                                payload_checksum=checksum(frame),
                                base_checksum=s.get("base_checksum", HEX) if codec == "delta" else None))
        body += frame
        offset += len(frame)
    man = Manifest(codec=codec, tier=tier, version=2, base_version=1 if codec == "delta" else None, checksum=HEX,
                   base_checksum=HEX if codec == "delta" else None, tensors=specs, layout_hash=members.hash,
                   members=members)
    return Payload(man, memoryview(body)).to_bytes()


def _packed(numel: int, table: bytes, n_changed: int = 0, n_esc: int = 0, dtype: str = "BF16",
            base_checksum: str = HEX) -> bytes:
    """One delta-packed segment whose sections hold n_changed changes and n_esc escapes (all zero bytes)."""
    parts = {"table": table, "gaps_lo": b"", "gaps_hi": b"", "steps": b"", "escapes": b""}
    for p in ("gaps_lo", "gaps_hi", "steps"):
        parts[p] = _rle_frame(n_changed) if n_changed else b""
    if n_esc:
        parts["escapes"] = _rle_frame(n_esc * 2)
    return _forge([{"name": "w", "dtype": dtype, "numel": numel, "kind": "delta-packed", "parts": parts,
                    "base_checksum": base_checksum}])


def _table(counts: np.ndarray, escapes: np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=True).compress(np.concatenate([counts, escapes]).astype("<u4").tobytes())


def _bombs() -> dict[str, bytes]:
    """Each declares about a gigabyte: allocating it shows in peak RSS, yet a run that allocates it still ends."""
    nc = 1 << 12  # a 2^28-element tensor's chunks
    full = np.full(nc, 1 << 16, np.uint32)
    return {
        # a 2^42-element segment whose all-zero chunk table unpacks to 512 MiB from 16 KiB
        "table": _packed(1 << 42, _rle_frame(8 << 26)),
        # a dense change of 2^28 bf16 elements: 512 MiB of XOR data from 16 KiB
        "xor": _forge([{"name": "w", "dtype": "BF16", "numel": 1 << 28, "kind": "xor",
                        "parts": {"data": _rle_frame(1 << 29, 1)}}]),
        # a table claiming every element of 2^28 changed: 768 MiB of gaps and steps
        "gaps": _packed(1 << 28, _table(full, np.zeros(nc, np.uint32)), n_changed=1 << 28),
        # half as many changes, every one escaped: 384 MiB of gaps and steps, 256 MiB of escapes
        "escapes": _packed(1 << 27, _table(full[: nc // 2], full[: nc // 2]), n_changed=1 << 27, n_esc=1 << 27),
    }


CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    def vm():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    import wsync
    from wsync import api
    from wsync.errors import WsyncError
    from wsync.payload import Payload
    resource.setrlimit(resource.RLIMIT_AS, (vm() + (3 << 30), resource.RLIM_INFINITY))
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    path = sys.argv[1]
    base = {"w": np.arange(4096, dtype=np.uint16)}
    before = base["w"].copy()

    def step(name, fn):
        start = peak()
        try:
            fn()
            got = "ok"
        except WsyncError as e:
            got = type(e).__name__ + ": " + str(e)[:160]
        except BaseException as e:
            got = "ESCAPED " + type(e).__name__ + ": " + str(e)[:160]
        print(json.dumps({"step": name, "result": got, "growth": peak() - start}), flush=True)

    step("read", lambda: Payload.read(path))
    step("inspect", lambda: api.inspect(path))
    def prepare():
        api.prepare(Payload.from_bytes(open(path, "rb").read()))
    step("prepare", prepare)
    step("apply", lambda: wsync.apply(base, path))
    step("apply in place", lambda: wsync.apply(base, path, inplace=True))
    step("decode", lambda: api.decode(wsync.bind(base), Payload.read(path)))
    print(json.dumps({"step": "base unchanged", "result": bool((base["w"] == before).all()), "growth": 0}))
""")


def _run_child(path) -> list[dict]:
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, WSYNC_THREADS="1", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.mark.parametrize("bomb", ["table", "xor", "gaps", "escapes"])
def test_decompression_bombs_are_refused_without_allocating(bomb, tmp_path):
    blob = _bombs()[bomb]
    assert len(blob) < 1 << 20
    path = tmp_path / f"{bomb}.wsd"
    path.write_bytes(blob)
    steps = _run_child(path)
    assert [s["step"] for s in steps] == ["read", "inspect", "prepare", "apply", "apply in place", "decode",
                                          "base unchanged"]
    for s in steps:
        assert s["growth"] < GROWTH_LIMIT, s
        assert "ESCAPED" not in str(s["result"]), s
    by = {s["step"]: s["result"] for s in steps}
    assert by["base unchanged"] is True
    for name in ("apply", "apply in place", "decode"):
        assert by[name] != "ok", by  # a refusal, by a WsyncError (checked above)


def test_zstd_rle_helper_is_a_real_frame():
    assert zstandard.ZstdDecompressor().decompress(_rle_frame(300_000, 7)) == bytes([7]) * 300_000


def _dense_pair(n=1 << 16):
    base = {"w": np.arange(n, dtype=np.uint16)}
    return base, {"w": base["w"] + 1}


def test_a_section_larger_than_zstd_can_expand_is_refused():
    from wsync.codecs.base import zstd_decompress

    header = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", 1 << 40)
    with pytest.raises(FormatError, match="cannot hold"):
        zstd_decompress(header + b"\x01\x00\x00\x00", 1 << 40, "data")
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1000))
    with pytest.raises(FormatError, match="content size"):
        zstd_decompress(no_size, 1000, "data")


def test_a_packed_delta_claiming_more_than_its_tensor_is_refused():
    """A table within the base's size but claiming a change denser than any delta the encoder writes."""
    n = 1 << 16
    base = {"w": np.arange(n, dtype=np.uint16)}
    blob = _packed(n, _table(np.array([n], np.uint32), np.zeros(1, np.uint32)), n_changed=n, dtype="U16",
                   base_checksum=checksum(base["w"]))
    before = base["w"].copy()
    for inplace in (False, True):
        with pytest.raises(FormatError, match="more than the"):
            wsync.apply(base, blob, inplace=inplace)
    assert base["w"].tobytes() == before.tobytes()


def test_prepare_leaves_a_lying_segment_to_apply_and_honest_ones_unpacked():
    base = _dense_pair()[0]
    new = {"w": base["w"].copy()}
    new["w"][::50] += 7  # 2% changed: a packed delta
    honest = api.prepare(Payload.from_bytes(wsync.encode(base, new, tier="packed").to_bytes()))
    assert len(honest.unpacked) == 1 and next(iter(honest.unpacked.values())) is not None
    bomb = api.prepare(Payload.from_bytes(_bombs()["table"]))
    assert bomb.unpacked == {}
    out = wsync.apply(base, honest)
    assert out["w"].tobytes() == new["w"].tobytes()


def test_a_shape_of_many_huge_dims_is_refused_before_its_product_is_taken():
    """200,000 dimensions of 2^62: the rank limit must come before the product, whose bigint work would take minutes."""
    blob = wsync.encode(None, _dense_pair(1024)[1], codec="raw").to_bytes()
    for where in ("members", "segments"):
        def lie(doc):
            if where == "members":
                doc["members"]["shapes"][0] = [1 << 62] * 200_000
            else:
                doc["segments"][0]["shape"] = [1 << 62] * 200_000

        crafted = rewrite_manifest(blob, lie)
        code = "import sys; from wsync.payload import Payload; Payload.from_bytes(sys.stdin.buffer.read())"
        try:  # a guard against a hang, not a timing: refusing it takes milliseconds
            r = subprocess.run([sys.executable, "-c", code], input=crafted, capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a {where} shape of 200,000 dimensions kept the parser busy for a minute")
        assert b"FormatError" in r.stderr and b"at most 64" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("shape, ok", [([], True), ([1] * 64, True), ([1] * 65, False), ([1 << 50], True),
                                       ([(1 << 50) + 1], False), ([1 << 25, 1 << 25], True), ([1 << 25, 1 << 26], False),
                                       ([0, 1 << 50, 1 << 50], True), ([-1], False), ([True], False), ("3", False)])
def test_shape_numel_takes_shapes_within_its_bounds_and_refuses_the_rest(shape, ok):
    from wsync.layout import shape_numel

    if ok:
        assert shape_numel(shape, "t") == int(np.prod(shape, dtype=object) if shape else 1)
    else:
        with pytest.raises(FormatError, match="shape"):
            shape_numel(shape, "t")


def test_an_int_too_long_for_python_is_a_format_error():
    blob = wsync.encode(None, _dense_pair(1024)[1], codec="raw", version=2).to_bytes()
    _, version, mlen, blen, _ = HEADER.unpack_from(blob)
    m = blob[HEADER.size : HEADER.size + mlen].replace(b'"version":2', b'"version":' + b"9" * 5000)
    assert len(m) > mlen
    lie = HEADER.pack(MAGIC, version, len(m), blen, xxhash.xxh3_64_intdigest(m)) + m + blob[HEADER.size + mlen :]
    with pytest.raises(FormatError):
        Payload.from_bytes(lie)


# ---- deep JSON ------------------------------------------------------------------------------------------------

def _deep_manifest_payload(depth: int = 100_000) -> bytes:
    blob = wsync.encode(None, _dense_pair(1024)[1], codec="raw").to_bytes()
    _, version, mlen, blen, _ = HEADER.unpack_from(blob)
    m = blob[HEADER.size : HEADER.size + mlen].replace(b'"metadata":{}', b'"metadata":' + b"[" * depth + b"]" * depth)
    assert len(m) > mlen
    return HEADER.pack(MAGIC, version, len(m), blen, xxhash.xxh3_64_intdigest(m)) + m + blob[HEADER.size + mlen :]


def test_deep_json_in_a_manifest_is_a_format_error():
    blob = _deep_manifest_payload()
    for call in (Payload.from_bytes, api.inspect, lambda b: wsync.apply(None, b)):
        with pytest.raises(FormatError, match="nests deeper"):
            call(blob)


def test_cli_inspect_of_deep_json_prints_one_line(tmp_path):
    path = tmp_path / "deep.wsd"
    path.write_bytes(_deep_manifest_payload())
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "inspect", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "nests deeper" in r.stderr, r.stderr


def test_safejson_limits_depth_outside_strings_only():
    from wsync import safejson
    from wsync.errors import JSONError

    assert safejson.loads(b"[" * 64 + b"]" * 64) == eval("[" * 64 + "]" * 64)
    assert safejson.loads(json.dumps({"name": "[" * 5000 + '\\"{'})) == {"name": "[" * 5000 + '\\"{'}
    assert safejson.loads(memoryview(b'{"a": [1, "]]]"]}')) == {"a": [1, "]]]"]}
    for bad in (b"[" * 65 + b"]" * 65, b'{"a":' * 70 + b"1" + b"}" * 70, b"[" * 100_000, b"\xff", b"[1" + b"0" * 5000 + b"]",
                b'"\\"' + b"[" * 100):
        with pytest.raises(JSONError):
            safejson.loads(bad)
    with pytest.raises(JSONError, match="limit"):
        safejson.loads(b"[]" + b" " * 100, max_bytes=50)
    assert issubclass(JSONError, FormatError) and issubclass(JSONError, ValueError)


DEEP = b'{"kind":"bucket","meta":' + b"[" * 5000 + b"]" * 5000 + b',"sizes":[],"frame":65536}'


def test_deep_json_from_a_peer_is_a_transport_error():
    """A bad header is a TransportError (the subscriber reconnects), and so is a deep one."""
    from wsync.errors import TransportError
    from wsync.transports import envelope
    from wsync.transports.tcp import frames

    with pytest.raises(TransportError, match="nests deeper"):
        frames.decode_head(envelope.seal(DEEP), 1 << 30)
    with pytest.raises(TransportError, match="nests deeper"):
        frames.decode_state(b'{"next":0,"partial":' + b"[" * 5000 + b"]" * 5000 + b"}", 10)
    with pytest.raises(TransportError, match="nests deeper"):
        envelope.parse(envelope.seal(DEEP), may=("frame",))


def test_deep_json_in_a_safetensors_header_is_a_format_error(tmp_path):
    header = b'{"__metadata__":{"a":"b"},"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    from wsync.checkpoint import read_safetensors

    with pytest.raises(FormatError, match="nests deeper"):
        read_safetensors(path)
