"""encode / apply / inspect: the codec API on whole states.

apply() is all-or-nothing: every checksum is verified before a result is
returned, and an in-place apply that fails on any tensor puts back every
element it changed, so the caller's state is the old version or the new one.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np

from . import backends, dtypes
from .checksum import state_digest
from .codecs import CODECS
from .codecs.base import Applied, Decoded, Encoded, Overwritten
from .errors import ChecksumError, FormatError, MismatchError, VersionError
from .manifest import Manifest, TensorSpec
from .payload import Payload, as_payload
from .snapshot import State, TensorBits, aliases, as_state, digest, to_torch


def _load(obj) -> tuple[State, dict | None, dict]:
    if isinstance(obj, (str, os.PathLike)):
        from .checkpoint import read_checkpoint

        ck = read_checkpoint(obj)
        return ck.state, ck.layout, ck.metadata
    return as_state(obj), None, {}


def _check_same_tensors(base: State, specs: list[tuple[str, str, tuple]], what: str) -> None:
    """base must hold exactly the named tensors with these dtypes and shapes."""
    names = {n for n, _, _ in specs}
    missing, extra = sorted(names - set(base)), sorted(set(base) - names)
    if missing or extra:
        raise MismatchError(f"{what}: tensor names differ: missing from base {missing[:5]}, not in {what} {extra[:5]} "
                            f"({len(missing)} missing, {len(extra)} extra)")
    for name, dt, shape in specs:
        b = base[name]
        if (b.dtype.name, b.shape) != (dt, shape):
            raise MismatchError(f"{what}: tensor {name!r} is {dt}{list(shape)} but base has {b.dtype.name}{list(b.shape)}")


def encode(base, new, *, codec: str = "delta", tier: str | None = "packed", version: int | None = None,
           base_version: int | None = None, level: int = 1, backend: str | None = None) -> Payload:
    """Encode `new` (against `base` for delta) into a Payload.

    base/new: dicts of torch tensors or numpy arrays, safetensors files, or
    checkpoint folders. level: zstd level of the packed tier's entropy stage.
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    tier = None if codec == "raw" else tier
    if codec == "delta" and tier not in ("sparse", "packed"):
        raise ValueError(f"delta tier must be 'sparse' or 'packed', got {tier!r}")
    k = backends.kernels(backend)
    new_state, layout, metadata = _load(new)
    base_state = None
    if codec == "delta":
        if base is None:
            raise ValueError("the delta codec needs a base")
        base_state = _load(base)[0]
        _check_same_tensors(base_state, [(n, t.dtype.name, t.shape) for n, t in new_state.items()], "new")
    mod = CODECS[codec]
    encoded = [(name, tb, base_state[name] if base_state else None) for name, tb in new_state.items()]
    encoded = [(name, tb, b, mod.encode_tensor(b, tb, tier=tier, kernels=k, level=level)) for name, tb, b in encoded]
    return _payload(encoded, k, base_state, codec=codec, tier=tier, version=version, base_version=base_version,
                    layout=layout, metadata=metadata)


def encode_measured(measured: list[tuple[str, TensorBits, Encoded]], *, tier: str, version: int | None = None,
                    base_version: int | None = None, level: int = 1, backend: str | None = None) -> Payload:
    """A delta payload from tensors delta.measure()d ahead, in base order.

    Only the names, dtypes and shapes of the TensorBits are read (their
    memory may have changed since), and the measured parts and checksums.
    """
    k = backends.kernels(backend)
    encoded = [(name, tb, None, CODECS["delta"].pack(enc, level)) for name, tb, enc in measured]
    layout_of_base = {name: tb for name, tb, _ in measured}
    return _payload(encoded, k, layout_of_base, codec="delta", tier=tier, version=version,
                    base_version=base_version, layout=None, metadata={})


def _payload(encoded: list, k, base_state: State | None, **fields) -> Payload:
    """Body and manifest; base_state is read for its names, dtypes and shapes only (checksums come measured)."""
    body, specs = _assemble(encoded, k)
    manifest = Manifest(
        checksum=state_digest((s.name, s.dtype, s.shape, s.checksum) for s in specs),
        base_checksum=digest(base_state, {s.name: s.base_checksum for s in specs}) if base_state else None,
        tensors=specs, **fields,
    )
    return Payload(manifest, memoryview(body))


def _assemble(encoded: list, k) -> tuple[np.ndarray, list[TensorSpec]]:
    """Lay every tensor's frame into one body, checksumming each frame as it is copied in."""
    lengths = [{p: memoryview(v).nbytes for p, v in enc.parts.items()} for *_, enc in encoded]
    body = np.empty(sum(sum(ls.values()) for ls in lengths), np.uint8)
    specs, offset = [], 0
    for (name, tb, b, enc), ls in zip(encoded, lengths):
        frame = body[offset : offset + sum(ls.values())]
        if len(enc.parts) == 1:  # raw data: copy and checksum in one pass
            frame_sum = k.copy_checksummed(next(iter(enc.parts.values())), frame)
        else:
            at = 0
            for p, v in enc.parts.items():
                frame[at : at + ls[p]] = np.frombuffer(v, np.uint8)
                at += ls[p]
            frame_sum = k.checksum(frame)
        new_sum = enc.new_sum or (frame_sum if enc.verbatim else k.checksum(tb.bits))
        base_sum = enc.base_sum or (k.checksum(b.bits) if b else None)
        specs.append(TensorSpec(name=name, dtype=tb.dtype.name, shape=tb.shape, kind=enc.kind, offset=offset, parts=ls,
                                checksum=new_sum, payload_checksum=frame_sum, base_checksum=base_sum))
        offset += len(frame)
    body.flags.writeable = False
    return body, specs


def decode(base: State | None, payload: Payload, *, backend: str | None = None) -> dict[str, Decoded]:
    """Verify and decode every tensor without touching base. Raises on the first problem.

    Errors rank as they would if every base checksum were checked first:
    VersionError (wrong base) before any problem with the payload's bytes.
    """
    k = backends.kernels(backend)
    man = payload.manifest
    needs_base = _check_inputs(base, man)
    out = {}
    for i, spec in enumerate(man.tensors):
        b = base[spec.name] if base is not None else None
        with _base_errors_first(base, man, i, k, needs_base):
            dec = _decode_one(payload, spec, b, k)
        if needs_base:
            _check_base_sum(spec, man, dec.base_sum or k.checksum(b.bits))
        out[spec.name] = dec
    return out


def _decode_one(payload: Payload, spec: TensorSpec, b: TensorBits | None, k) -> Decoded:
    _check_frame(payload, spec, k)
    codec = CODECS[payload.manifest.codec]
    return codec.decode_tensor(b, spec, payload.parts(spec), kernels=k, dtype=dtypes.by_name(spec.dtype))


def _check_inputs(base: State | None, man: Manifest) -> bool:
    """Base present when needed and shaped like the payload; True if its checksums must be verified."""
    needs_base = man.codec == "delta"
    if base is not None or needs_base:
        if base is None:
            raise VersionError(f"payload is a delta against version {man.base_version}; a base is required")
        _check_same_tensors(base, [(s.name, s.dtype, s.shape) for s in man.tensors], "payload")
    return needs_base


def _check_frame(payload: Payload, spec: TensorSpec, k) -> None:
    if k.checksum(payload.frame(spec)) != spec.payload_checksum:
        raise ChecksumError(f"{spec.name}: stored bytes do not match their checksum (corrupt in transit or on disk)")


def _check_base_sum(spec: TensorSpec, man: Manifest, got: str) -> None:
    if got != spec.base_checksum:
        raise VersionError(f"base tensor {spec.name!r} differs from the one this delta was made against "
                           f"(payload base version {man.base_version}; checksum {got} != {spec.base_checksum})")


@contextmanager
def _base_errors_first(base: State | None, man: Manifest, i: int, k, needs_base: bool, known: dict | None = None):
    """A payload error at tensor i yields to a wrong base at tensor i or later (earlier ones passed)."""
    try:
        yield
    except (ChecksumError, FormatError):
        if needs_base:
            for spec in man.tensors[i:]:
                _check_base_sum(spec, man, (known or {}).get(spec.name) or k.checksum(base[spec.name].bits))
        raise


def prepare(payload: Payload, *, backend: str | None = None) -> Payload:
    """Check each tensor's stored bytes and do the decoding that needs no base (zstd stages), ahead of apply.

    A subscriber calls this as each bucket of a version arrives, so the apply
    at the end touches little more than the engine's tensors. It stops
    quietly at the first problem: apply meets it again and raises it, ranked
    as always (a wrong base before a corrupt payload).
    """
    codec = CODECS.get(payload.manifest.codec)
    if codec is None:
        return payload
    k = backends.kernels(backend)
    for spec in payload.manifest.tensors:
        if spec.name in payload.unpacked:
            continue
        try:
            _check_frame(payload, spec, k)
            payload.unpacked[spec.name] = codec.unpack(spec, payload.parts(spec), dtypes.by_name(spec.dtype))
        except Exception:  # noqa: BLE001  (apply does this work again and raises it properly)
            break
    return payload


def apply_state(base: State | None, payload, *, backend: str | None = None) -> State:
    """Out-of-place apply on TensorBits states; every checksum verified before returning."""
    return _apply(base, as_payload(payload), backends.kernels(backend), inplace=False)


def _apply(base: State | None, payload: Payload, k, *, inplace: bool, log: list | None = None) -> State:
    """Verify and apply every tensor, each in as few passes as the backend fuses.

    Errors rank as in decode, and a result that misses its checksum only
    after every tensor passed the other checks. In place, any error puts
    back every element written, last tensor first.
    """
    man = payload.manifest
    needs_base = _check_inputs(base, man)
    codec = CODECS[man.codec]
    shared, known = _decode_shared(base, payload, k) if inplace else ({}, {})
    done: list[Applied] = []
    late = None
    try:
        for i, spec in enumerate(man.tensors):
            b = base[spec.name] if base is not None else None
            with _base_errors_first(base, man, i, k, needs_base, known):
                if spec.name in shared:
                    a = _scatter(shared[spec.name], b, k)
                else:
                    if spec.name not in payload.unpacked:
                        _check_frame(payload, spec, k)
                    a = codec.apply_tensor(b, spec, payload.parts(spec), kernels=k, dtype=dtypes.by_name(spec.dtype),
                                           inplace=inplace, base_sum=needs_base, unpacked=payload.unpacked.get(spec.name))
            done.append(a)
            if needs_base:
                _check_base_sum(spec, man, a.base_sum)
            if a.new_sum != spec.checksum and late is None:
                late = ChecksumError(f"{spec.name}: decoded tensor does not match its checksum")
        if late is not None:
            raise late
    except BaseException:
        for a in reversed(done):
            a.undo()
        raise
    if log is not None:
        log.extend(done)
    return {s.name: TensorBits(dtypes.by_name(s.dtype), s.shape, a.bits) for s, a in zip(man.tensors, done)}


def _decode_shared(base: State | None, payload: Payload, k) -> tuple[dict, dict]:
    """Tensors whose memory overlaps another's (tied weights), decoded before anything is written.

    Applied in place one by one, such a tensor would see the writes made for
    its twin, in its base checksum and in the steps added to it. Decoded
    against the untouched base, it behaves as if applied alone. Returns
    ({name: Decoded, or the exception to raise when the loop reaches it},
    {name: checksum of its base as it was}).
    """
    out, sums = {}, {}
    for name in _overlapping(base or {}):
        sums[name] = k.checksum(base[name].bits)
        try:
            out[name] = _decode_one(payload, payload.manifest.tensors_by_name[name], base[name], k)
            out[name].base_sum = sums[name]
        except (ChecksumError, FormatError) as e:
            out[name] = e
    return out, sums


def _overlapping(state: State) -> set[str]:
    spans = sorted((tb.bits.__array_interface__["data"][0], tb.bits.nbytes, n) for n, tb in state.items() if tb.bits.nbytes)
    out, end, owner = set(), -1, None
    for start, size, name in spans:
        if start < end:  # overlaps the span reaching furthest so far
            out.update((name, owner))
        if start + size > end:
            end, owner = start + size, name
    return out


def _scatter(dec, b: TensorBits, k) -> Applied:
    if isinstance(dec, Exception):
        raise dec
    old = dec.scatter_into(b.bits)
    return Applied(b.bits, k.checksum(b.bits), dec.base_sum, Overwritten(old, dec.positions))


def apply(base, payload, *, inplace: bool = False, backend: str | None = None):
    """Apply a payload to base and return the new tensors.

    base: a dict of torch tensors or numpy arrays (the result has the same
    flavour), a safetensors file or checkpoint folder (torch result), or None
    for a raw payload. inplace=True writes into base's own memory (CPU,
    contiguous) and returns base; on any error base is left exactly as it was.
    """
    payload = as_payload(payload)
    base_state = None if base is None else _load(base)[0]
    if inplace:
        if not isinstance(base, dict):
            raise TypeError("inplace=True needs a dict of tensors or arrays as base")
        _apply_inplace(base, base_state, payload, backend)
        return base
    result = apply_state(base_state, payload, backend=backend)
    if isinstance(base, dict) and base and all(isinstance(v, np.ndarray) for v in base.values()):
        return {n: tb.bits.view(base[n].dtype).reshape(tb.shape) for n, tb in result.items()}
    return {n: to_torch(tb) for n, tb in result.items()}


def _apply_inplace(base: dict, state: State, payload: Payload, backend) -> None:
    for name, tb in state.items():
        if not tb.bits.flags.writeable or not aliases(base[name], tb.bits):
            raise TypeError(f"inplace apply needs writable, contiguous CPU tensors; {name!r} is not")
    _apply(state, payload, backends.kernels(backend), inplace=True)


def apply_payloads_inplace(state: State, payloads: list[Payload], *, backend: str | None = None):
    """Apply several payloads (the buckets of one version) in place, as one: all or nothing.

    Each payload covers some of state's tensors. Returns a function that puts
    every written element back, for a caller whose own later check fails.
    """
    k = backends.kernels(backend)
    log: list = []

    def undo() -> None:
        for a in reversed(log):
            a.undo()

    try:
        for p in payloads:
            _apply({s.name: state[s.name] for s in p.manifest.tensors}, p, k, inplace=True, log=log)
    except BaseException:
        undo()
        raise
    return undo


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
        "tensors": len(man.tensors),
        "elements": elements,
        "changed": changed,
        "density": changed / elements if elements else 0.0,
        "model_bytes": model_bytes,
        "payload_bytes": size,
        "header_bytes": size - len(payload.body),
        "ratio": model_bytes / size if size else 0.0,
        "bits_per_changed": 8 * size / changed if changed else None,
        "parts": parts,
        "kinds": kinds,
    }


def _changed(spec: TensorSpec, payload: Payload) -> int:
    """Changed elements of one tensor (raw tensors count as all changed)."""
    if spec.kind == "same":
        return 0
    if not spec.kind.startswith("delta"):
        return spec.numel
    from .codecs.base import zstd_decompress
    from .codecs.delta_ref import nchunks

    nc = nchunks(spec.numel)
    table = payload.parts(spec)["table"]
    if spec.kind == "delta-packed":
        table = zstd_decompress(table, 8 * nc, f"{spec.name}: table")
    return int(np.frombuffer(table, "<u4")[:nc].sum(dtype=np.int64))
