"""The wire header: a JSON manifest describing every segment of a payload.

Format 2 codes segments (the tensors of one dtype, back to back; layout.py),
so the manifest holds one entry per segment, not per tensor, and names its
member table by hash; the table itself rides inline only where the receiver
cannot have it already (keyframes, files). Format 1 (one entry per tensor,
wsync 0.1) is refused with a message saying so.

The manifest is the only thing a receiver trusts before checksums are checked,
so parsing it is strict: every field has a type, every length is checked
against the dtype and shape it claims, and the tensors' byte ranges must tile
the body exactly. Nothing here is ever pickle.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property

from . import dtypes, safejson
from .checksum import ALGO
from .errors import FormatError
from .layout import MAX_ELEMENTS, Layout, shape_numel

FORMAT_VERSION = 2
READERS = {1: "wsync 0.1.x (pip install 'wsync<0.2')"}  # older formats, and which wsync reads them
CHUNK_ELEMS = 1 << 16  # elements per independent delta chunk; positions fit in uint16

# Which byte sections each (codec, kind) stores, in body order.
PARTS = {
    ("raw", "raw"): ("data",),
    ("delta", "same"): (),
    ("delta", "raw"): ("data",),
    ("delta", "xor"): ("data",),
    ("delta", "delta-sparse"): ("table", "gaps", "steps", "escapes"),
    ("delta", "delta-packed"): ("table", "gaps_lo", "gaps_hi", "steps", "escapes"),
    ("delta", "delta-v2"): ("model", "index", "pos", "steps"),  # codecs/v2_ref.py
}
TIERS = {"raw": (None,), "delta": ("sparse", "packed", "v2")}


@dataclass(kw_only=True)
class TensorSpec:
    """One segment of a payload (a single tensor is a segment of one). name: "<layout hash>:<index>"."""

    name: str
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    kind: str  # how this tensor is stored; see PARTS
    offset: int = 0  # start of this tensor's bytes in the body
    parts: dict[str, int] = field(default_factory=dict)  # section -> byte length, in body order
    checksum: str  # xxh3 of the decoded tensor bytes
    payload_checksum: str  # xxh3 of this tensor's stored bytes
    base_checksum: str | None = None  # xxh3 of the base tensor a delta applies to

    @property
    def length(self) -> int:
        return sum(self.parts.values())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.by_name(self.dtype).itemsize

    @property
    def nchunks(self) -> int:
        return -(-self.numel // CHUNK_ELEMS)


@dataclass(kw_only=True)
class Manifest:
    codec: str  # "raw" or "delta"
    tier: str | None  # delta: "sparse" or "packed"; raw: None
    version: int | None = None  # version this payload produces
    base_version: int | None = None  # version it must be applied to (delta)
    checksum: str  # digest of the whole resulting state
    base_checksum: str | None = None  # digest of the whole base state (delta)
    tensors: list[TensorSpec]
    layout_hash: str  # the member table's hash (layout.Layout.hash)
    members: Layout | None = None  # the member table itself, when it travels inline
    layout: dict[str, str] | None = None  # tensor -> shard file name of the source checkpoint ("files" in JSON)
    metadata: dict[str, str] = field(default_factory=dict)  # free-form strings, e.g. safetensors __metadata__

    @cached_property
    def tensors_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @property
    def body_length(self) -> int:
        return sum(t.length for t in self.tensors)

    def to_json(self) -> bytes:
        doc = {
            "format": "wsync",
            "format_version": FORMAT_VERSION,
            "checksum_algo": ALGO,
            "chunk_elems": CHUNK_ELEMS,
            "codec": self.codec,
            "tier": self.tier,
            "version": self.version,
            "base_version": self.base_version,
            "checksum": self.checksum,
            "base_checksum": self.base_checksum,
            "layout_hash": self.layout_hash,
            "members": None if self.members is None else self.members.to_doc(),
            "files": self.layout,
            "metadata": self.metadata,
            "segments": [_spec_doc(t) for t in self.tensors],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Manifest":
        return _parse(safejson.loads(raw, what="manifest"))


def _spec_doc(t: TensorSpec) -> dict:
    return {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "kind": t.kind,
        "offset": t.offset,
        "parts": [[k, v] for k, v in t.parts.items()],
        "checksum": t.checksum,
        "payload_checksum": t.payload_checksum,
        "base_checksum": t.base_checksum,
    }


def _get(doc: dict, key: str, types, where: str, *, optional: bool = False):
    if key not in doc:
        if optional:
            return None
        raise FormatError(f"{where}: missing field {key!r}")
    v = doc[key]
    if v is None and optional:
        return None
    # bool is an int in Python; a manifest that says `true` for a length is lying.
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise FormatError(f"{where}: field {key!r} must be {types}, got {v!r}")
    if not isinstance(v, types):
        raise FormatError(f"{where}: field {key!r} must be {types}, got {type(v).__name__} {v!r:.60}")
    return v


def _hex16(v, where: str) -> str:
    if not (isinstance(v, str) and len(v) == 16 and all(c in "0123456789abcdef" for c in v)):
        raise FormatError(f"{where}: checksum must be 16 lowercase hex digits, got {v!r:.40}")
    return v


def _parse(doc) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != "wsync":
        raise FormatError("manifest is not a wsync manifest (no 'format': 'wsync')")
    fv = _get(doc, "format_version", int, "manifest")
    if fv != FORMAT_VERSION:
        raise FormatError(unsupported(fv))
    if _get(doc, "checksum_algo", str, "manifest") != ALGO:
        raise FormatError(f"unsupported checksum algorithm {doc['checksum_algo']!r}; expected {ALGO!r}")
    if _get(doc, "chunk_elems", int, "manifest") != CHUNK_ELEMS:
        raise FormatError(f"unsupported chunk size {doc['chunk_elems']}; expected {CHUNK_ELEMS}")
    codec = _get(doc, "codec", str, "manifest")
    if codec not in TIERS:
        raise FormatError(f"unknown codec {codec!r}; known: {', '.join(TIERS)}")
    tier = _get(doc, "tier", str, "manifest", optional=True)
    if tier not in TIERS[codec]:
        raise FormatError(f"codec {codec!r} has no tier {tier!r}; known: {TIERS[codec]}")
    base_checksum = _get(doc, "base_checksum", str, "manifest", optional=True)
    layout = _get(doc, "files", dict, "manifest", optional=True)
    metadata = _get(doc, "metadata", dict, "manifest", optional=True) or {}
    for k, v in list((layout or {}).items()) + list(metadata.items()):
        if not isinstance(v, str):
            raise FormatError(f"manifest: layout/metadata value for {k!r} must be a string")
    raw_tensors = _get(doc, "segments", list, "manifest")
    tensors = [_parse_spec(t, i, codec, tier) for i, t in enumerate(raw_tensors)]
    _check_tiling(tensors)
    layout_hash = _hex16(_get(doc, "layout_hash", str, "manifest"), "manifest: layout_hash")
    members_doc = _get(doc, "members", dict, "manifest", optional=True)
    members = None if members_doc is None else Layout.from_doc(members_doc)
    _check_segments(tensors, layout_hash, members)
    return Manifest(
        layout_hash=layout_hash,
        members=members,
        codec=codec,
        tier=tier,
        version=_get(doc, "version", int, "manifest", optional=True),
        base_version=_get(doc, "base_version", int, "manifest", optional=True),
        checksum=_hex16(_get(doc, "checksum", str, "manifest"), "manifest"),
        base_checksum=None if base_checksum is None else _hex16(base_checksum, "manifest"),
        tensors=tensors,
        layout=layout,
        metadata=metadata,
    )


def _parse_spec(d, i: int, codec: str, tier: str | None) -> TensorSpec:
    where = f"tensor #{i}"
    if not isinstance(d, dict):
        raise FormatError(f"{where}: expected an object")
    name = _get(d, "name", str, where)
    where = f"tensor #{i} {name!r}"
    dt = dtypes.by_name(_get(d, "dtype", str, where))
    shape = _get(d, "shape", list, where)
    shape_numel(shape, where)
    kind = _get(d, "kind", str, where)
    expected = PARTS.get((codec, kind))
    if expected is None or (kind.startswith("delta-") and kind != f"delta-{tier}"):
        raise FormatError(f"{where}: kind {kind!r} is not valid for codec {codec!r} tier {tier!r}")
    parts = _get(d, "parts", list, where)
    if [p[0] if isinstance(p, list) and p else None for p in parts] != list(expected):
        raise FormatError(f"{where}: parts must be {list(expected)}, got {parts!r:.120}")
    if not all(len(p) == 2 and isinstance(p[1], int) and not isinstance(p[1], bool) and p[1] >= 0 for p in parts):
        raise FormatError(f"{where}: part lengths must be non-negative ints, got {parts!r:.120}")
    offset = _get(d, "offset", int, where)
    base = _get(d, "base_checksum", str, where, optional=True)
    spec = TensorSpec(
        name=name,
        dtype=dt.name,
        shape=tuple(shape),
        kind=kind,
        offset=offset,
        parts={k: v for k, v in parts},
        checksum=_hex16(_get(d, "checksum", str, where), where),
        payload_checksum=_hex16(_get(d, "payload_checksum", str, where), where),
        base_checksum=None if base is None else _hex16(base, where),
    )
    _check_lengths(spec, where)
    return spec


def _check_lengths(spec: TensorSpec, where: str) -> None:
    """Lengths that follow from dtype and shape alone; the rest is checked when decoding."""
    if spec.kind == "raw" and spec.parts["data"] != spec.nbytes:
        raise FormatError(f"{where}: raw data is {spec.parts['data']} bytes, but {spec.dtype}{list(spec.shape)} needs {spec.nbytes}")
    if spec.kind == "delta-sparse" and spec.parts["table"] != 8 * spec.nchunks:
        raise FormatError(f"{where}: chunk table is {spec.parts['table']} bytes, expected {8 * spec.nchunks}")
    if spec.kind in ("delta-sparse", "delta-v2") and spec.length >= spec.nbytes:  # the encoder stores such a change whole
        raise FormatError(f"{where}: {spec.length} bytes of delta sections for a {spec.nbytes}-byte tensor")
    if spec.kind.startswith("delta") and spec.base_checksum is None:
        raise FormatError(f"{where}: a delta tensor needs a base_checksum")


def unsupported(fv) -> str:
    reader = READERS.get(fv)
    if reader:
        return (f"payload format version {fv} was written by an older wsync; this wsync reads format {FORMAT_VERSION}. "
                f"Read it with {reader}, or re-encode it from its checkpoints")
    return f"unsupported format version {fv}; this wsync reads version {FORMAT_VERSION}"


def check_members(tensors: list[TensorSpec], members: Layout) -> None:
    """The segments are exactly those of the member table: keys, dtypes and element counts."""
    if [t.name for t in tensors] != members.keys():
        raise FormatError(f"payload segments {[t.name for t in tensors][:3]} do not match its layout {members.hash} "
                          f"({len(members.counts)} segments)")
    for j, (t, dt, n) in enumerate(zip(tensors, members.dtypes, members.seg_numels)):
        if t.dtype != dt or t.shape != (n,):
            raise FormatError(f"segment {t.name} ({members.describe(j)}): {t.dtype}[{t.numel}] but its layout says "
                              f"{dt}[{n}]")


def _check_segments(tensors: list[TensorSpec], layout_hash: str, members: Layout | None) -> None:
    for t in tensors:
        if len(t.shape) != 1 or not t.name.startswith(layout_hash + ":"):
            raise FormatError(f"segment {t.name!r}: expected a 1-D segment named '{layout_hash}:<index>'")
    if members is not None:
        if members.hash != layout_hash:
            raise FormatError(f"manifest: the member table hashes to {members.hash}, the manifest says {layout_hash}")
        check_members(tensors, members)


def _check_tiling(tensors: list[TensorSpec]) -> None:
    names = set()
    pos = elements = 0
    for t in tensors:
        elements += t.numel
        if elements > MAX_ELEMENTS:
            raise FormatError(f"manifest: segments declare more than {MAX_ELEMENTS} elements")
        if t.name in names:
            raise FormatError(f"tensor {t.name!r} appears twice in the manifest")
        names.add(t.name)
        if t.offset != pos:
            raise FormatError(f"tensor {t.name!r} starts at body offset {t.offset}, expected {pos} (ranges must tile the body)")
        pos += t.length
