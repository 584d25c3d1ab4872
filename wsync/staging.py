"""What a subscriber holds for versions it has not applied yet, and the bound on it in bytes.

A subscriber receives each version whole before applying it, so what it holds
is sized by the publisher; a token holder (a hostile publisher, or a relay
that went bad) can announce anything. Every size a version declares is held
to what one version of the layout the engine serves can take on the wire, with
every codec's worst case (``version_bound``), before anything is allocated for
it: the link refuses a larger message at its header (``TcpLink.limit``), and a
version's bucket count and bytes may not add up to more. Before any layout is
known (an engine with no tensors yet) the bound is a stated cap.

An engine that polls seldom, or never, must not make the subscriber hold every
version that arrived meanwhile. ``Staging`` keeps one keyframe and the deltas
after it: a keyframe supersedes every version staged before it (applying those
first would end in the very state the keyframe carries; a raw version is a
keyframe), and deltas after it that would take more than twice the bound are
dropped, and the subscriber asks for a keyframe instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from . import dtypes
from .errors import TransportError
from .payload import Payload

# Wire bytes per tensor beyond its data: a segment's manifest entry (~350 bytes), a bucket's own fields
# (every bucket holds a tensor), and the zstd frame headers of a delta's sections.
PER_TENSOR = 2048
HEAD_SLACK = 64 << 10  # a version's manifest fields beyond those: codec, checksums, metadata
NO_LAYOUT_BYTES = 64 << 30  # the stated cap while no layout is known (an engine that holds no tensors yet)
MIN_BUCKET = 4096  # with only a byte cap to go by, a version has at most cap / MIN_BUCKET buckets
NOTE_BYTES = 4096  # a version's note (publish(note=...)) as JSON: a label, never data


class Oversized(TransportError):
    """A publisher announced a version larger than the layout this subscriber serves allows; refused
    before anything was allocated for it."""


def version_bound(model_bytes: int, tensors: int, table_bytes: int) -> int:
    """The most wire bytes one version of a model may take: raw stores each segment's bytes; a delta stores
    a changed segment raw, as XOR (zstd adds at most 1/256 and a frame header) or as sections smaller than
    the segment (each zstd'd); each bucket's head holds its manifest and, in a keyframe, its member table
    (table_bytes: the tables' JSON)."""
    return model_bytes + model_bytes // 128 + tensors * PER_TENSOR + 2 * table_bytes + HEAD_SLACK


def table_bytes(names, ndims) -> int:
    """At most the JSON of a member table of these names and shapes (21 bytes per dimension: int64's
    digits and a comma)."""
    return sum(len(json.dumps(n)) + 1 for n in names) + sum(21 * d + 3 for d in ndims)


@dataclass(frozen=True)
class Limits:
    """What one version may take; why: where it comes from, for the refusal."""

    version_bytes: int
    buckets: int
    why: str

    @classmethod
    def of_layouts(cls, members: list) -> "Limits":
        """From the member tables of the version the engine serves."""
        names = [n for m in members for n in m.names]
        shapes = [s for m in members for s in m.shapes]
        model = sum(int(m.numels[m.bounds[j]: m.bounds[j + 1]].sum()) * _itemsize(dt)
                    for m in members for j, dt in enumerate(m.dtypes))
        return cls._of(model, names, [len(s) for s in shapes], "the layout this subscriber serves")

    @classmethod
    def of_tensors(cls, named: dict) -> "Limits | None":
        """From the engine's own tensors (None if it holds none)."""
        if not named:
            return None
        model = sum(int(getattr(t, "nbytes", 0)) for t in named.values())
        ndims = [len(getattr(t, "shape", ())) for t in named.values()]
        return cls._of(model, list(named), ndims, "the engine's tensors")

    @classmethod
    def stated(cls, cap: int, why: str) -> "Limits":
        return cls(cap, max(1, cap // MIN_BUCKET), why)

    @classmethod
    def _of(cls, model: int, names: list, ndims: list, what: str) -> "Limits":
        n = len(names)
        bound = version_bound(model, n, table_bytes(names, ndims))
        return cls(bound, max(n, 1), f"one version can take ({what}: {n} tensors, {model} bytes, "
                                     "with every codec's worst case)")


def check_note(note, error=ValueError) -> dict | None:
    """A version's note as publish() takes it and a subscriber accepts it: None, or a JSON object of string
    keys within NOTE_BYTES; error (the exception class) otherwise."""
    if note is None:
        return None
    if not isinstance(note, dict) or not all(isinstance(k, str) for k in note):
        raise error(f"a version's note must be a JSON object with string keys, got {type(note).__name__}")
    try:
        text = json.dumps(note, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise error(f"a version's note must be plain JSON: {e}") from None
    if len(text) > NOTE_BYTES:
        raise error(f"a version's note is {len(text)} bytes as JSON; at most {NOTE_BYTES}")
    return json.loads(text)  # a copy: the caller's dict may change after publish()


def _itemsize(dtype_name: str) -> int:
    return dtypes.by_name(dtype_name).itemsize


class Received:
    """One version, received whole and parsed (payload checksums are checked when it is applied)."""

    def __init__(self, meta: dict, limits: Limits):
        self.version: int = meta["version"]
        self.base_version: int | None = meta["base_version"]
        self.count: int = meta["count"]
        if not (type(self.version) is int and type(self.count) is int):
            raise TransportError(f"bucket message with version {self.version!r:.40}, count {self.count!r:.40}")
        if not 1 <= self.count <= limits.buckets:
            raise Oversized(f"version {self.version} announced {self.count} buckets; at most {limits.buckets} "
                            f"fit what {limits.why}")
        self.limits = limits
        self.checksum: str | None = meta["checksum"]  # the digest comes with the last bucket
        at = meta.get("published_at")  # the publisher's wall clock at publish(), for the latency metric
        self.published_at: float | None = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) \
            else None
        self.note: dict | None = check_note(meta.get("note"), TransportError)
        self.payloads: list[Payload] = []
        self.nbytes = 0  # wire bytes
        self.held = 0  # wire bytes and what was unpacked from them ahead of apply

    def add(self, nbytes: int) -> None:
        """Count a bucket of nbytes, before it is kept: Oversized past the version's bound."""
        if self.nbytes + nbytes > self.limits.version_bytes:
            raise Oversized(f"version {self.version} has reached {self.nbytes + nbytes} bytes at bucket "
                            f"{len(self.payloads)} of {self.count}, above the {self.limits.version_bytes} bytes "
                            f"{self.limits.why}")
        self.nbytes += nbytes
        self.held += nbytes

    def kept(self, payload: Payload) -> None:
        self.payloads.append(payload)
        self.held += sum(s.sparse_size() for s in payload.unpacked.values() if s is not None)

    @property
    def keyframe(self) -> bool:
        return all(p.manifest.codec == "raw" for p in self.payloads)


class Staging:
    """Versions received and not yet applied, in order: at most one keyframe and the deltas after it, and
    no more than `cap` bytes of them (callers hold the subscriber's lock)."""

    def __init__(self):
        self.items: list[Received] = []
        self.gap = False  # deltas were dropped: take none until a keyframe comes

    @property
    def held(self) -> int:
        return sum(st.held for st in self.items)

    def add(self, st: Received, cap: int) -> bool:
        """Stage st; False when deltas had to be dropped (st among them) and a keyframe is needed."""
        if st.keyframe:
            # applying the versions before it would end where it starts: in the state it carries
            self.items = [s for s in self.items if s.version >= st.version]
            self.gap = False
        elif self.gap:
            return True  # asked for a keyframe already: this delta's chain is broken here
        self.items.append(st)
        if len(self.items) > 1 and self.held > cap:
            # the first stays: it applies to what the engine serves (or is a keyframe); the rest wait for one
            del self.items[1:]
            self.gap = True
            return False
        return True

    def take(self) -> Received | None:
        return self.items.pop(0) if self.items else None

    def __bool__(self) -> bool:
        return bool(self.items)
