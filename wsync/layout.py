"""Which tensors a payload carries, and how they are cut into segments: the layout.

A payload codes *segments*, not tensors: the tensors of one dtype, back to back
in the order of the member table (see tables.py). The member table (names,
shapes, how many tensors each segment holds and its dtype) is the layout. It
is hashed, and a payload names its layout by that hash; the table itself
travels inline only where the receiver cannot already have it (a keyframe, a
file). Deltas of the sync protocol refer to the keyframe's layout by hash, so
the per-version manifest of a 70,000-tensor model stays a few hundred bytes.

Building a layout, or checking one against a state, costs a Python step per
tensor; it is done once per layout and cached (``Bound``), never per version.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import xxhash

from . import dtypes
from .errors import FormatError, MismatchError
from .snapshot import State, TensorBits, aliases, as_state, unique_tensors
from .tables import Table, as_array

MAX_MEMBERS = 1 << 22  # a table this long is a lie, not a model
MAX_ELEMENTS = 1 << 50  # nor a payload of more elements than this (the counts stay far from int64 overflow)
MAX_DIMS = 64  # torch allows 64 dimensions; more is a lie (and a product of thousands of huge ints is slow)


def shape_numel(shape, where: str) -> int:
    """The element count of an untrusted shape (a list of ints), checked before anything is sized from it.

    Each dimension and the running product are held to MAX_ELEMENTS, so the
    product of a crafted shape never grows into a huge integer, and a count
    that passes fits int64 with room to add many of them.
    """
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS):
        raise FormatError(f"{where}: shape must be a list of at most {MAX_DIMS} ints, got {shape!r:.80}")
    n = 1
    for d in shape:
        if not (isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ELEMENTS):
            raise FormatError(f"{where}: shape must hold non-negative ints, got {shape!r:.80}")
        n *= d
        if n > MAX_ELEMENTS:
            raise FormatError(f"{where}: shape {shape!r:.80} declares more than {MAX_ELEMENTS} elements")
    return n


@dataclass(frozen=True, eq=False)
class Layout:
    """A payload's tensors, in body order, grouped into segments of one dtype each."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]  # tensors in each segment, in order
    dtypes: tuple[str, ...]  # each segment's dtype (safetensors code)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def hash(self) -> str:
        """xxh3-64 of the canonical JSON of the table: what a payload calls its layout by."""
        return xxhash.xxh3_64_hexdigest(json.dumps(self.to_doc(), separators=(",", ":")).encode())

    @cached_property
    def numels(self) -> np.ndarray:
        return np.array([math.prod(s) for s in self.shapes], np.int64)

    @cached_property
    def bounds(self) -> np.ndarray:
        """Index of each segment's first member, and the total, last."""
        return np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])

    @cached_property
    def seg_numels(self) -> list[int]:
        b = self.bounds
        return [int(self.numels[b[j] : b[j + 1]].sum()) for j in range(len(self.counts))]

    def keys(self) -> list[str]:
        """Each segment's name in a manifest: the layout hash and its index (unique across a version's buckets)."""
        return [f"{self.hash}:{j}" for j in range(len(self.counts))]

    def segment_names(self, j: int) -> tuple[str, ...]:
        b = self.bounds
        return self.names[b[j] : b[j + 1]]

    def describe(self, j: int) -> str:
        """A segment, for error messages: its one tensor's name, or its first and last and how many."""
        names = self.segment_names(j)
        if len(names) == 1:
            return names[0]
        return f"the {len(names)} {self.dtypes[j]} tensors {names[0]!r} .. {names[-1]!r}"

    def to_doc(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "counts": list(self.counts), "dtypes": list(self.dtypes)}

    @classmethod
    def from_doc(cls, doc) -> "Layout":
        """Parse and check a member table from a manifest (untrusted)."""
        if not isinstance(doc, dict):
            raise FormatError("manifest: members must be an object")
        names, shapes, counts, dts = (doc.get(k) for k in ("names", "shapes", "counts", "dtypes"))
        if not all(isinstance(v, list) for v in (names, shapes, counts, dts)):
            raise FormatError("manifest: members needs lists 'names', 'shapes', 'counts' and 'dtypes'")
        if len(names) > MAX_MEMBERS or len(names) != len(shapes) or len(counts) != len(dts):
            raise FormatError(f"manifest: members has {len(names)} names, {len(shapes)} shapes, {len(counts)} counts, "
                              f"{len(dts)} dtypes")
        if not all(isinstance(n, str) and n for n in names):
            raise FormatError("manifest: member names must be non-empty strings")
        if len(set(names)) != len(names):
            raise FormatError("manifest: a member name appears twice")
        if sum(shape_numel(s, "manifest: member") for s in shapes) > MAX_ELEMENTS:
            raise FormatError(f"manifest: members declare more than {MAX_ELEMENTS} elements")
        if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts) or sum(counts) != len(names):
            raise FormatError(f"manifest: segment counts {counts!r:.80} do not add up to {len(names)} members")
        return cls(tuple(names), tuple(tuple(s) for s in shapes), tuple(counts),
                   tuple(dtypes.by_name(d).name for d in dts))


def layout_of(state: State, names=None) -> Layout:
    """The layout of `names` of state (all of it by default): one segment per dtype, in order of first use."""
    names = list(state) if names is None else list(names)
    by_dtype: dict[str, list[str]] = {}
    for n in names:
        by_dtype.setdefault(state[n].dtype.name, []).append(n)
    ordered = [n for group in by_dtype.values() for n in group]
    return Layout(tuple(ordered), tuple(state[n].shape for n in ordered),
                   tuple(len(g) for g in by_dtype.values()), tuple(by_dtype))


def per_tensor(state: State, names=None) -> Layout:
    """A layout with one segment per tensor: format 1's granularity (a payload entry per tensor), for
    callers that want errors and checksums per tensor and few tensors."""
    names = list(state) if names is None else list(names)
    return Layout(tuple(names), tuple(state[n].shape for n in names), (1,) * len(names),
                   tuple(state[n].dtype.name for n in names))


def check_against(state: State, members: Layout, what: str = "payload") -> None:
    """state holds every member with its dtype and shape (it may hold more). MismatchError otherwise."""
    missing = [n for n in members.names if n not in state]
    if missing:
        raise MismatchError(f"{what}: {len(missing)} tensors are not in the base, e.g. {missing[:5]}")
    for j in range(len(members.counts)):
        dt = members.dtypes[j]
        b = members.bounds
        for i in range(b[j], b[j + 1]):
            tb = state[members.names[i]]
            if tb.dtype.name != dt or tb.shape != members.shapes[i]:
                raise MismatchError(f"{what}: tensor {members.names[i]!r} is {dt}{list(members.shapes[i])} but the "
                                    f"base has {tb.dtype.name}{list(tb.shape)}")


def check_covers(state: State, names, what: str, mine: str = "base", theirs: str = "payload") -> None:
    """state holds exactly `names`, no more and no fewer; MismatchError naming the difference otherwise."""
    if len(names) == len(state) and all(n in state for n in names):
        return
    have = set(names)
    missing, extra = sorted(have - set(state)), sorted(set(state) - have)
    raise MismatchError(f"{what}: tensor names differ: {theirs}-only {missing[:5]}, {mine}-only {extra[:5]} "
                        f"({len(missing)} and {len(extra)})")


def segments(state: State, members: Layout) -> list[TensorBits]:
    """Each segment of `members` as one virtual tensor over state's memory (cached when state is Bound)."""
    if isinstance(state, Bound):
        return state.segments(members)
    check_against(state, members)
    return _segments(state, members)


def _segments(state: State, members: Layout) -> list[TensorBits]:
    out = []
    for j, dt_name in enumerate(members.dtypes):
        dt = dtypes.by_name(dt_name)
        names = members.segment_names(j)
        pieces = []
        for n in names:
            bits = state[n].bits
            pieces += bits.pieces if isinstance(bits, Table) else [bits]  # a virtual tensor: its pieces
        bits = pieces[0] if len(pieces) == 1 else Table(pieces, dt.bits_dtype)
        out.append(TensorBits(dt, (members.seg_numels[j],), bits))
    return out


def split(members: Layout, seg_bits: list[np.ndarray]) -> State:
    """Per-tensor views of contiguous segment arrays (an out-of-place result)."""
    out = {}
    for j, bits in enumerate(seg_bits):
        dt = dtypes.by_name(members.dtypes[j])
        b = members.bounds
        at = 0
        for i in range(b[j], b[j + 1]):
            n = int(members.numels[i])
            out[members.names[i]] = TensorBits(dt, members.shapes[i], bits[at : at + n])
            at += n
    return out


class Bound(dict):
    """A state (name -> TensorBits) whose segment tables are built once per layout and reused.

    ``wsync.bind(model.state_dict())`` once, then publish or apply the Bound
    every version: nothing per tensor happens in Python after the first.
    The tensors must stay where they are (an optimizer step or an in-place
    load does; ``model.to(...)`` or ``load_state_dict(assign=True)`` does not:
    bind again after those).
    """

    bound = True  # snapshot.as_state passes a Bound through as it is

    def __init__(self, state: State, writes_through: bool = False, sources: dict | None = None):
        super().__init__(state)
        self.writes_through = writes_through  # every TensorBits is a writable view of the caller's own tensor
        # name -> the caller's tensor, for each TensorBits that holds a copy of it (a device tensor, a strided
        # view): refresh() reads them again
        self.sources: dict = sources or {}
        self._segs: dict[int, tuple[Layout, list[TensorBits]]] = {}
        self._cached: dict = {}
        self._copier = None

    def refresh(self) -> None:
        """Read every copied tensor afresh from its source, into the same host arrays.

        A Bound views memory that keeps changing; where it could only copy
        (device memory, a strided view), the copy would freeze the first
        version, so whoever reads the Bound for a new version calls this first.
        """
        if self.sources:
            if self._copier is None:
                self._copier = _Copier({n: self[n] for n in self.sources}, self.sources)
            self._copier.pull()

    def segments(self, members: Layout) -> list[TensorBits]:
        hit = self._segs.get(id(members))
        if hit is not None and hit[0] is members:
            return hit[1]
        check_against(self, members)
        segs = _segments(self, members)
        if len(self._segs) > 64:
            self._segs.clear()
        self._segs[id(members)] = (members, segs)
        return segs

    def cached(self, key, make):
        """A value computed once per key (e.g. the bucket plan for a bucket size)."""
        if key not in self._cached:
            self._cached[key] = make()
        return self._cached[key]


def bind(obj) -> Bound:
    """A state to publish or apply into every version: its segment tables are built once.

    obj: a state_dict or dict of arrays (tied weights are kept once, under the
    first name). The Bound views the tensors' own memory; see Bound for when
    to bind again.
    """
    if isinstance(obj, Bound):
        return obj
    return bind_copying(unique_tensors(obj))


def bind_copying(named: dict) -> Bound:
    """A Bound over `named` that views each tensor it can and keeps a writable copy of every other one.

    A tensor is viewed when its bits are a writable view of its own memory
    (contiguous, on the host); any other (a device tensor, a strided or
    read-only one) gets a host copy of our own, with the tensor kept in
    Bound.sources, so the copy can be read again (refresh) or written back
    (load_back).
    """
    state = dict(as_state(named))
    sources = {}
    for n, tb in state.items():
        view = aliases(named[n], tb.bits)
        if view and _writable(tb.bits):
            continue
        if view or not _writable(tb.bits):  # someone else's memory we may not write: a copy of our own
            state[n] = TensorBits(tb.dtype, tb.shape, as_array(tb.bits).copy())
        sources[n] = named[n]
    return Bound(state, writes_through=not sources, sources=sources)


def _flat_or_array(t) -> np.ndarray:
    return as_array(t.bits) if isinstance(t, TensorBits) else t


def _writable(bits) -> bool:
    return bits.writable if isinstance(bits, Table) else bits.flags.writeable


class _Copier:
    """Copies a Bound's sources into its host arrays: torch's in one call (torch._foreach_copy_), so a
    20,000-tensor state costs no Python loop; numpy arrays and TensorBits (an engine's read-only views) one by
    one."""

    def __init__(self, host: dict, sources: dict):
        torch = sys.modules.get("torch")  # a torch tensor means torch is imported; numpy states need no torch
        self.src, self.dst, self.pairs = [], [], []
        for n, t in sources.items():
            if torch is not None and isinstance(t, torch.Tensor):
                t = t.detach()
                self.src.append(t)
                self.dst.append(torch.from_numpy(host[n].bits).view(t.dtype).view(t.shape))
            else:
                t = _flat_or_array(t)
                self.pairs.append((host[n].bits.view(t.dtype).reshape(t.shape), t))

    def pull(self) -> None:
        if self.src:
            sys.modules["torch"]._foreach_copy_(self.dst, self.src)
        for d, s in self.pairs:
            np.copyto(d, s)
