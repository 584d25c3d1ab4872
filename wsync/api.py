"""encode / apply / inspect: the codec API on whole states.

A payload codes segments (the tensors of one dtype, back to back, as one
element stream; layout.py), so a state of 20,000 small tensors costs what one
tensor of the same size costs: one kernel call, one chunk table and three
checksums per segment.

apply() is all-or-nothing: every checksum is verified before a result is
returned, and an in-place apply that fails on any tensor puts back every
element it changed, so the caller's state is the old version or the new one.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np

from . import backends, dtypes
from .codecs import CODECS
from .codecs.base import Applied, Decoded, Encoded, Overwritten
from .errors import ChecksumError, FormatError, MismatchError, VersionError
from .checksum import state_digest
from .layout import Bound, Layout, check_covers, layout_of, segments, split
from .manifest import Manifest, TensorSpec, check_members
from .payload import Payload, as_payload
from .snapshot import State, TensorBits, aliases, as_state, to_torch
from .tables import Table, byte_size


def _load(obj) -> tuple[State, dict | None, dict]:
    if isinstance(obj, (str, os.PathLike)):
        from .checkpoint import read_checkpoint

        ck = read_checkpoint(obj)
        return ck.state, ck.layout, ck.metadata
    return as_state(obj), None, {}


def _covers(state: State, members: Layout, what: str) -> None:
    """state holds exactly the members. segments() has found every member in it, so equal counts
    settle it without a look at each name (this runs every version)."""
    if len(state) != len(members.names):
        check_covers(state, members.names, what, theirs=what)


def _members_of(state: State, members: Layout | None) -> Layout:
    if members is not None:
        return members
    if isinstance(state, Bound):
        return state.cached("all", lambda: layout_of(state))
    return layout_of(state)


def encode(base, new, *, codec: str = "delta", tier: str | None = "packed", version: int | None = None,
           base_version: int | None = None, level: int = 1, backend: str | None = None,
           members: Layout | None = None, inline: bool = True) -> Payload:
    """Encode `new` (against `base` for delta) into a Payload.

    base/new: dicts of torch tensors or numpy arrays, safetensors files,
    checkpoint folders, or states bound once with wsync.bind (then nothing
    runs per tensor in Python). level: zstd level of the packed tier's
    entropy stage. members: the layout (which tensors, in which segments);
    default: all of new, one segment per dtype. inline: put the member table
    in the payload (False: the receiver knows it by hash, as sync deltas do).
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    tier = None if codec == "raw" else tier
    if codec == "delta" and tier not in ("sparse", "packed", "v2"):
        raise ValueError(f"delta tier must be 'sparse', 'packed' or 'v2', got {tier!r}")
    k = backends.kernels(backend)
    new_state, files, metadata = _load(new)
    members = _members_of(new_state, members)
    new_segs = segments(new_state, members)
    base_segs = None
    if codec == "delta":
        if base is None:
            raise ValueError("the delta codec needs a base")
        base_state = _load(base)[0]
        base_segs = segments(base_state, members)
        if len(new_state) == len(members.names):
            _covers(base_state, members, "new")
    mod = CODECS[codec]
    encoded = [(nb, bb, mod.encode_tensor(bb, nb, tier=tier, kernels=k, level=level))
               for nb, bb in zip(new_segs, base_segs or [None] * len(new_segs))]
    return _payload(encoded, k, members, inline, codec=codec, tier=tier, version=version, base_version=base_version,
                    layout=files, metadata=metadata)


def encode_measured(measured: list[tuple[TensorBits, Encoded]], members: Layout, *, tier: str,
                    version: int | None = None, base_version: int | None = None, level: int = 1,
                    backend: str | None = None, inline: bool = False) -> Payload:
    """A delta payload from segments delta.measure()d ahead, in members' order.

    Only the dtypes and sizes of the TensorBits are read (their memory may
    have changed since), and the measured parts and checksums.
    """
    k = backends.kernels(backend)
    encoded = [(tb, None, CODECS["delta"].pack(enc, level)) for tb, enc in measured]
    return _payload(encoded, k, members, inline, codec="delta", tier=tier, version=version,
                    base_version=base_version, layout=None, metadata={})


def _payload(encoded: list, k, members: Layout, inline: bool, **fields) -> Payload:
    body, specs = _assemble_on_device(encoded, k, members) if getattr(k, "keep", False) \
        else _assemble(encoded, k, members)
    delta = fields["codec"] == "delta"
    manifest = Manifest(
        checksum=state_digest((s.name, s.dtype, (s.numel,), s.checksum) for s in specs),
        base_checksum=state_digest((s.name, s.dtype, (s.numel,), s.base_checksum) for s in specs) if delta else None,
        tensors=specs, layout_hash=members.hash, members=members if inline else None, **fields,
    )
    return Payload(manifest, body if getattr(k, "keep", False) else memoryview(body))


def _assemble_on_device(encoded: list, k, members: Layout) -> tuple[object, list[TensorSpec]]:
    """_assemble's frames in a device body (backends.device.DeviceKernels.assemble), with the same specs."""
    body, frames = k.assemble(encoded, members.keys())
    return body, [_spec(key, seg, k, offset, ls, frame_sum) for seg, (key, offset, ls, frame_sum) in zip(encoded, frames)]


def _spec(key: str, seg: tuple, k, offset: int, lengths: dict, frame_sum: str) -> TensorSpec:
    """A segment's manifest entry, from its (new, base, Encoded) and where its frame lies in the body."""
    tb, b, enc = seg
    new_sum = enc.new_sum or (frame_sum if enc.verbatim else k.checksum(tb.bits))
    base_sum = enc.base_sum or (k.checksum(b.bits) if b else None)
    return TensorSpec(name=key, dtype=tb.dtype.name, shape=tb.shape, kind=enc.kind, offset=offset, parts=lengths,
                      checksum=new_sum, payload_checksum=frame_sum, base_checksum=base_sum)


def _assemble(encoded: list, k, members: Layout) -> tuple[np.ndarray, list[TensorSpec]]:
    """Lay every segment's frame into one body, checksumming each frame as it is copied in."""
    lengths = [{p: byte_size(v) for p, v in enc.parts.items()} for *_, enc in encoded]
    body = np.empty(sum(sum(ls.values()) for ls in lengths), np.uint8)
    specs, offset = [], 0
    for key, (tb, b, enc), ls in zip(members.keys(), encoded, lengths):
        frame = body[offset : offset + sum(ls.values())]
        if len(enc.parts) == 1:  # raw data: copy (a gather, for a table) and checksum in one pass
            frame_sum = k.copy_checksummed(next(iter(enc.parts.values())), frame)
        else:
            at = 0
            for p, v in enc.parts.items():
                frame[at : at + ls[p]] = np.frombuffer(v, np.uint8)
                at += ls[p]
            frame_sum = k.checksum(frame)
        specs.append(_spec(key, (tb, b, enc), k, offset, ls, frame_sum))
        offset += len(frame)
    body.flags.writeable = False
    return body, specs


def resolve(man: Manifest, layouts: dict | None = None) -> Layout:
    """The payload's member table: inline, or one the receiver already has under its hash."""
    if man.members is not None:
        return man.members
    members = (layouts or {}).get(man.layout_hash)
    if members is None:
        raise MismatchError(f"the payload refers to layout {man.layout_hash}, which this receiver does not hold "
                            "(a layout travels with keyframes: ask for one, or encode with inline=True)")
    check_members(man.tensors, members)
    return members


def decode(base: State | None, payload: Payload, *, backend: str | None = None,
           layouts: dict | None = None) -> dict[str, Decoded]:
    """Verify and decode every segment without touching base. Raises on the first problem.

    Returns {segment key: Decoded} (positions are within the segment).
    Errors rank as they would if every base checksum were checked first:
    VersionError (wrong base) before any problem with the payload's bytes.
    """
    k = backends.kernels(backend)
    man = payload.manifest
    members = resolve(man, layouts)
    base_segs = _base_segments(base, man, members, whole=True)
    out = {}
    for i, spec in enumerate(man.tensors):
        b = base_segs[i] if base_segs is not None else None
        with _base_errors_first(base_segs, man, members, i, k):
            dec = _decode_one(payload, spec, b, k, members.describe(i))
        if base_segs is not None and man.codec == "delta":
            _check_base_sum(spec, man, members.describe(i), dec.base_sum or k.checksum(b.bits))
        out[spec.name] = dec
    return out


def _decode_one(payload: Payload, spec: TensorSpec, b: TensorBits | None, k, what: str) -> Decoded:
    _check_frame(payload, spec, k, what)
    codec = CODECS[payload.manifest.codec]
    with _named(what):
        return codec.decode_tensor(b, spec, payload.parts(spec), kernels=k, dtype=dtypes.by_name(spec.dtype))


@contextmanager
def _named(what: str):
    """Say which tensors a FormatError from a segment's codec is about."""
    try:
        yield
    except FormatError as e:
        raise FormatError(f"{what}: {e}") from None


def _base_segments(base: State | None, man: Manifest, members: Layout, whole: bool) -> list[TensorBits] | None:
    """The base as the payload's segments, present when needed and shaped like the payload."""
    if base is None:
        if man.codec == "delta":
            raise VersionError(f"payload is a delta against version {man.base_version}; a base is required")
        return None
    segs = segments(base, members)
    if whole:
        _covers(base, members, "payload")
    return segs


def _check_frame(payload: Payload, spec: TensorSpec, k, what: str) -> None:
    if k.checksum(payload.frame(spec)) != spec.payload_checksum:
        raise ChecksumError(f"{what}: stored bytes do not match their checksum (corrupt in transit or on disk)")


def _check_base_sum(spec: TensorSpec, man: Manifest, what: str, got: str) -> None:
    if got != spec.base_checksum:
        raise VersionError(f"base {what} differs from the one this delta was made against "
                           f"(payload base version {man.base_version}; checksum {got} != {spec.base_checksum})")


@contextmanager
def _base_errors_first(base_segs, man: Manifest, members: Layout, i: int, k, known: dict | None = None):
    """A payload error at segment i yields to a wrong base at segment i or later (earlier ones passed)."""
    try:
        yield
    except (ChecksumError, FormatError):
        if base_segs is not None and man.codec == "delta":
            for j in range(i, len(man.tensors)):
                spec = man.tensors[j]
                got = (known or {}).get(spec.name) or k.checksum(base_segs[j].bits)
                _check_base_sum(spec, man, members.describe(j), got)
        raise


# What prepare may unpack per byte received. A packed delta unpacks to a few times its size; a section
# that claims far more may be a decompression bomb, and without the base prepare cannot tell: it leaves
# such a segment to apply, which checks the declared sizes against the base's first.
PREPARE_RATIO = 64
PREPARE_SLACK = 1 << 20


def prepare(payload: Payload, *, backend: str | None = None) -> Payload:
    """Check each segment's stored bytes and do the decoding that needs no base (zstd stages), ahead of apply.

    A subscriber calls this as each bucket of a version arrives, so the apply
    at the end touches little more than the engine's tensors. It stops
    quietly at the first problem: apply meets it again and raises it, ranked
    as always (a wrong base before a corrupt payload). It unpacks at most
    PREPARE_RATIO times the bytes received (plus PREPARE_SLACK), whatever the
    manifest declares.
    """
    codec = CODECS.get(payload.manifest.codec)
    if codec is None or payload.on_device:  # a device body is checked where it lies, when applied
        return payload
    k = backends.kernels(backend)
    budget = PREPARE_RATIO * len(payload.body) + PREPARE_SLACK
    for spec in payload.manifest.tensors:
        if spec.name in payload.unpacked:
            continue
        try:
            _check_frame(payload, spec, k, spec.name)
            sec = codec.unpack(spec, payload.parts(spec), dtypes.by_name(spec.dtype), limit=budget)
        except Exception:  # noqa: BLE001  (apply does this work again and raises it properly)
            break
        payload.unpacked[spec.name] = sec
        budget -= 0 if sec is None else sec.sparse_size()
    return payload


def apply_state(base: State | None, payload, *, backend: str | None = None, layouts: dict | None = None) -> State:
    """Out-of-place apply on TensorBits states; every checksum verified before returning."""
    payload = as_payload(payload)
    members, bits = _apply(base, payload, backends.kernels(backend), inplace=False, whole=True, layouts=layouts)
    return split(members, bits)


def _apply(base: State | None, payload: Payload, k, *, inplace: bool, whole: bool, log: list | None = None,
           layouts: dict | None = None) -> tuple[Layout, list]:
    """Verify and apply every segment, each in as few passes as the backend fuses.

    Errors rank as in decode, and a result that misses its checksum only
    after every segment passed the other checks. In place, any error puts
    back every element written, last segment first. Returns the layout and
    each segment's new bits (base's own memory, in place).
    """
    man = payload.manifest
    members = resolve(man, layouts)
    base_segs = _base_segments(base, man, members, whole)
    needs_base = man.codec == "delta"
    codec = CODECS[man.codec]
    shared, known = ({}, {})
    if inplace and base_segs:
        # which segments share memory is a property of where the tensors are: a Bound works it out once per layout
        tied = base.cached(("overlapping", members.hash), lambda: _overlapping(base_segs)) \
            if isinstance(base, Bound) else _overlapping(base_segs)
        shared, known = _decode_shared(tied, base_segs, payload, members, k)
    done: list[Applied] = []
    late = None
    try:
        for i, spec in enumerate(man.tensors):
            b = base_segs[i] if base_segs is not None else None
            what = members.describe(i)
            with _base_errors_first(base_segs if needs_base else None, man, members, i, k, known):
                if spec.name in shared:
                    a = _scatter(shared[spec.name], b, k)
                else:
                    if spec.name not in payload.unpacked:
                        _check_frame(payload, spec, k, what)
                    with _named(what):
                        a = codec.apply_tensor(b, spec, payload.parts(spec), kernels=k,
                                               dtype=dtypes.by_name(spec.dtype), inplace=inplace, base_sum=needs_base,
                                               unpacked=payload.unpacked.get(spec.name))
            done.append(a)
            if needs_base:
                _check_base_sum(spec, man, what, a.base_sum)
            if a.new_sum != spec.checksum and late is None:
                late = ChecksumError(f"{what}: decoded result does not match its checksum")
        if late is not None:
            raise late
    except BaseException:
        for a in reversed(done):
            a.undo()
        raise
    if log is not None:
        log.extend(done)
    return members, [a.bits for a in done]


def _decode_shared(tied: set[int], base_segs: list[TensorBits], payload: Payload, members: Layout,
                   k) -> tuple[dict, dict]:
    """Segments whose memory overlaps (tied weights), decoded before anything is written.

    Applied in place one by one, such a segment would see the writes made for
    its twin, in its base checksum and in the steps added to it. Decoded
    against the untouched base, it behaves as if applied alone. Returns
    ({key: Decoded, or the exception to raise when the loop reaches it},
    {key: checksum of its base as it was}).
    """
    out, sums = {}, {}
    specs = payload.manifest.tensors
    for i in tied:
        key = specs[i].name
        sums[key] = k.checksum(base_segs[i].bits)
        try:
            out[key] = _decode_one(payload, specs[i], base_segs[i], k, members.describe(i))
            out[key].base_sum = sums[key]
        except (ChecksumError, FormatError) as e:
            out[key] = e
    return out, sums


def _overlapping(segs: list[TensorBits]) -> set[int]:
    """Indices of segments with a piece whose memory overlaps another piece (of any segment, itself included)."""
    starts, ends, owner = [], [], []
    for i, tb in enumerate(segs):
        if isinstance(tb.bits, Table):
            addrs, at = tb.bits.arg()
            starts.append(addrs)
            ends.append(addrs + np.diff(at))
            owner.append(np.full(len(addrs), i))
        elif tb.bits.nbytes:
            a = tb.bits.__array_interface__["data"][0]
            starts.append(np.array([a], np.int64))
            ends.append(np.array([a + tb.bits.nbytes], np.int64))
            owner.append(np.array([i]))
    if not starts:
        return set()
    s, e, o = np.concatenate(starts), np.concatenate(ends), np.concatenate(owner)
    keep = e > s
    s, e, o = s[keep], e[keep], o[keep]
    order = np.argsort(s, kind="stable")
    s, e, o = s[order], e[order], o[order]
    run = np.maximum.accumulate(e)
    idx = np.maximum.accumulate(np.where(e == run, np.arange(len(e)), 0))
    hit = np.flatnonzero(s[1:] < run[:-1]) + 1
    return set(o[hit].tolist()) | set(o[idx[hit - 1]].tolist())


def _scatter(dec, b: TensorBits, k) -> Applied:
    if isinstance(dec, Exception):
        raise dec
    old = dec.scatter_into(b.bits)
    return Applied(b.bits, k.checksum(b.bits), dec.base_sum, Overwritten(old, dec.positions))


def apply(base, payload, *, inplace: bool = False, backend: str | None = None, layouts: dict | None = None):
    """Apply a payload to base and return the new tensors.

    base: a dict of torch tensors or numpy arrays (the result has the same
    flavour), a state bound with wsync.bind, a safetensors file or checkpoint
    folder (torch result), or None for a raw payload. inplace=True writes
    into base's own memory (CPU, contiguous) and returns base; on any error
    base is left exactly as it was. layouts: {hash: Layout} for payloads
    encoded with inline=False (they name their member table by hash).
    """
    payload = as_payload(payload)
    if isinstance(base, Bound):
        base_state = base
    else:
        base_state = None if base is None else _load(base)[0]
    if inplace:
        if not isinstance(base, dict):
            raise TypeError("inplace=True needs a dict of tensors or arrays as base")
        _apply_inplace(base, base_state, payload, backend, layouts)
        return base
    result = apply_state(base_state, payload, backend=backend, layouts=layouts)
    if isinstance(base, dict) and base and all(isinstance(v, np.ndarray) for v in base.values()):
        return {n: tb.bits.view(base[n].dtype).reshape(tb.shape) for n, tb in result.items()}
    return {n: to_torch(tb) for n, tb in result.items()}


def _apply_inplace(base: dict, state: State, payload: Payload, backend, layouts: dict | None) -> None:
    if isinstance(base, Bound):
        if not base.writes_through:
            raise TypeError("inplace apply needs writable, contiguous CPU tensors; this bound state copied some")
    else:
        for name, tb in state.items():
            if not tb.bits.flags.writeable or not aliases(base[name], tb.bits):
                raise TypeError(f"inplace apply needs writable, contiguous CPU tensors; {name!r} is not")
    _apply(state, payload, backends.kernels(backend), inplace=True, whole=True, layouts=layouts)


def apply_payloads_inplace(state: State, payloads: list[Payload], *, backend: str | None = None,
                           layouts: dict | None = None, log: list | None = None):
    """Apply several payloads (the buckets of one version) in place, as one: all or nothing.

    Each payload covers some of state's tensors. Returns (a function that puts
    every written element back, for a caller whose own later check fails,
    and the (key, dtype, numel, checksum) of every segment written).
    log: a list to extend with each segment's Applied, in order (what it overwrote, and where).
    """
    k = backends.kernels(backend)
    log = [] if log is None else log

    def undo() -> None:
        for a in reversed(log):
            a.undo()

    records = []
    try:
        for p in payloads:
            _apply(state, p, k, inplace=True, whole=False, log=log, layouts=layouts)
            records += [(s.name, s.dtype, (s.numel,), s.checksum) for s in p.manifest.tensors]
    except BaseException:
        undo()
        raise
    return undo, records


def apply_to_checkpoint(base_path, payload, out_path) -> None:
    """Apply to a checkpoint on disk and write the result; nothing is written unless all checks pass."""
    from .checkpoint import Checkpoint, read_checkpoint, write_checkpoint

    payload = as_payload(payload)
    ck = read_checkpoint(base_path)
    new = apply_state(ck.state, payload)
    man = payload.manifest
    write_checkpoint(out_path, Checkpoint(new, man.layout or ck.layout, man.metadata or ck.metadata), copy_from=base_path)


def inspect(payload) -> dict:
    """Summary of a payload: versions, density, bytes per part, ratio vs raw, bits per change."""
    payload = as_payload(payload)
    man = payload.manifest
    parts: dict[str, int] = {}
    kinds: dict[str, int] = {}
    elements = model_bytes = changed = 0
    for spec in man.tensors:
        for p, n in spec.parts.items():
            parts[p] = parts.get(p, 0) + n
        kinds[spec.kind] = kinds.get(spec.kind, 0) + 1
        elements += spec.numel
        model_bytes += spec.nbytes
        changed += _changed(spec, payload)
    size = payload.nbytes
    return {
        "codec": man.codec,
        "tier": man.tier,
        "version": man.version,
        "base_version": man.base_version,
        "tensors": None if man.members is None else len(man.members.names),  # None: the layout is not inline
        "segments": len(man.tensors),
        "layout_hash": man.layout_hash,
        "elements": elements,
        "changed": changed,
        "density": changed / elements if elements else 0.0,
        "model_bytes": model_bytes,
        "payload_bytes": size,
        "header_bytes": size - len(payload.body),
        "manifest_bytes": len(man.to_json()),
        "ratio": model_bytes / size if size else 0.0,
        "bits_per_changed": 8 * size / changed if changed else None,
        "parts": parts,
        "kinds": kinds,
    }


def _changed(spec: TensorSpec, payload: Payload) -> int:
    """Changed elements of one segment (raw segments count as all changed).

    Without a base, the segment's size is only what the manifest declares, so
    zstd sections are read in bounded pieces, never unpacked whole.
    """
    from .codecs.base import zstd_blocks
    from .codecs.delta_ref import nchunks

    if spec.kind == "same":
        return 0
    if spec.kind == "xor":  # a dense change: the elements whose XOR with the base is not zero
        bits_dt = dtypes.by_name(spec.dtype).bits_dtype
        return _count(zstd_blocks(payload.parts(spec)["data"], spec.nbytes, f"{spec.name}: xor data"), bits_dt,
                      lambda x: np.count_nonzero(x))
    if not spec.kind.startswith("delta"):
        return spec.numel
    if spec.kind == "delta-v2":  # the model's first varint
        from .codecs.v2_ref import get_varint
        return get_varint(payload.parts(spec)["model"], 0, f"{spec.name}: v2 model", spec.numel)[0]
    nc = nchunks(spec.numel)
    table = payload.parts(spec)["table"]
    if spec.kind == "delta-sparse":
        return int(np.frombuffer(table, "<u4")[:nc].sum(dtype=np.int64))
    counts = _prefix(zstd_blocks(table, 8 * nc, f"{spec.name}: table"), 4 * nc)
    return _count(counts, np.dtype("<u4"), lambda x: x.sum(dtype=np.int64))


def _count(pieces, dtype: np.dtype, fn) -> int:
    """The sum of fn over pieces of bytes viewed as dtype (an element may straddle two pieces)."""
    total, rest = 0, b""
    for piece in pieces:
        data = rest + piece if rest else piece
        whole = len(data) - len(data) % dtype.itemsize
        total += int(fn(np.frombuffer(data, dtype, whole // dtype.itemsize)))
        rest = bytes(data[whole:])
    return total


def _prefix(pieces, n: int):
    """The first n bytes of a stream of pieces (what follows is never read)."""
    for piece in pieces:
        yield piece[:n]
        n -= len(piece)
        if n <= 0:
            return
