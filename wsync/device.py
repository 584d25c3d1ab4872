"""States that live on a GPU: a version found, encoded and applied where the weights are.

A trainer's and an engine's weights are CUDA tensors. Reading them into host
memory for every version costs a full pass over PCIe on each side and makes
the CPU do what the GPU kernels (backends/cuda.py) do faster. Here, both ends
work on device buffers:

- trainer (``DeviceSource``): publish() copies the state's tensors into one
  flat device buffer per segment of each bucket, on the caller's current
  stream (the optimizer's), records an event and returns. The encoder thread
  waits for that event, finds the changes against the previous version's
  buffers with the delta kernels, hashes both on the GPU, and copies only the
  sections to the host (the payload's bytes). A keyframe's raw bytes cross
  whole, since a host link needs them. The previous version's buffers are the
  base: with the new snapshot, two model-sized copies on the device, recycled
  every version (publish() waits while one snapshot is still queued).
- engine (``DeviceEngine``): each segment of a version is applied with undo
  into the engine's own tensors (gathered into a staging buffer of one
  segment when the segment spans several tensors, and written back after),
  verified by its digest on the GPU; any failure puts back every segment
  already written. Extra device memory: one segment, plus the undo values.

Both count the bytes that cross between device and host (``Transfers``).
Everything goes through a CudaKernels and its runtime, so the CPU test suite
runs this code unchanged over the kernels on CPU fibers and a fake runtime.
"""
from __future__ import annotations

import numpy as np

from . import backends, dtypes
from .backends.device import Transfers, is_device
from .codecs import CODECS
from .codecs.delta import xor_data
from .codecs.delta_ref import DeltaSections
from .errors import BackendUnavailable, ChecksumError, FormatError, MismatchError, VersionError
from .checksum import state_digest
from .layout import Bound, Layout, check_covers, layout_of
from .snapshot import TensorBits, plan_buckets


def device_kernels():
    """The GPU kernels for device tensors, or None where they cannot load (no GPU, no cupy)."""
    try:
        return backends.device_kernels()
    except BackendUnavailable:
        return None


def on_one_device(named: dict):
    """The device kernels, if every tensor of `named` is a contiguous tensor on one GPU and they load; else None."""
    values = list(named.values())
    if not values or not all(is_device(t) for t in values):
        return None
    k = device_kernels()
    if k is None:
        return None
    rt = k.rt
    if len({rt.device_of(t) for t in values}) != 1 or not all(t.is_contiguous() for t in values):
        return None
    return k


class DeviceState(Bound):
    """One version of a device state: a flat device buffer per segment of each bucket.

    Names map to TensorBits with the tensors' dtypes and shapes (what layouts
    and checks read); the bits are the segments' buffers, handed out by
    segments() for the bucket layouts the buffers were made for.
    """

    def __init__(self, meta: dict, buckets: list[Layout], buffers: list[list], ready=None):
        super().__init__(meta, writes_through=False)
        self.buckets, self.buffers, self.ready = buckets, buffers, ready
        self.key = tuple(m.hash for m in buckets)
        self._by_hash = {m.hash: [TensorBits(dtypes.by_name(dt), (n,), buf) for dt, n, buf
                                  in zip(m.dtypes, m.seg_numels, bufs)] for m, bufs in zip(buckets, buffers)}

    def segments(self, members: Layout) -> list[TensorBits]:
        segs = self._by_hash.get(members.hash)
        if segs is None:
            raise MismatchError(f"layout {members.hash} is not one this device state was cut into")
        return segs

    def wait(self, names=None) -> None:
        """Block until the copies publish() queued have run (the encoder reads nothing before)."""
        ready, self.ready = self.ready, None
        if ready is not None:
            ready.synchronize()


class DeviceSource:
    """A trainer's device tensors, and how to snapshot them into a DeviceState (planned once)."""

    def __init__(self, named: dict, k, bucket_bytes: int):
        self.k, self.rt = k, k.rt
        self.named = named
        rt = self.rt
        meta = {n: TensorBits(rt.dtype_of(t), tuple(t.shape), None) for n, t in named.items()}
        self.meta = meta
        self.device = rt.device_of(next(iter(named.values())))
        self.buckets = [layout_of(meta, names) for names in plan_buckets([(n, tb.nbytes) for n, tb in meta.items()],
                                                                      bucket_bytes)]
        self.key = tuple(m.hash for m in self.buckets)

    def snapshot(self, spare=None) -> DeviceState:
        """Copy the tensors into device buffers on the caller's stream; returns at once (an event marks the end).

        spare: an older DeviceState of this layout, whose buffers nobody reads any more."""
        rt, first = self.rt, next(iter(self.named.values()))
        reuse = isinstance(spare, DeviceState) and spare.key == self.key
        buffers = []
        with rt.stream_of(first):  # torch's current stream on the tensors' device: after the optimizer step
            for i, m in enumerate(self.buckets):
                bufs = []
                for j, dt in enumerate(m.dtypes):
                    buf = spare.buffers[i][j] if reuse else rt.empty_tensor(m.seg_numels[j], dtypes.by_name(dt),
                                                                             self.device)
                    rt.gather(buf, [self.named[n] for n in m.segment_names(j)])
                    bufs.append(buf)
                buffers.append(bufs)
            ready = rt.record_event()
        return DeviceState(self.meta, self.buckets, buffers, ready)


class DeviceEngine:
    """An engine whose tensors are on one GPU: versions applied there, in place, as transactions."""

    def __init__(self, named: dict, k, transfers: Transfers):
        self.named, self.k, self.rt, self.transfers = named, k, k.rt, transfers
        self.meta = {n: TensorBits(self.rt.dtype_of(t), tuple(t.shape), None) for n, t in named.items()}
        self.host = backends.kernels()
        self._checked: set[str] = set()  # layouts already checked against the engine's tensors

    def apply(self, payloads: list, checksum: str, members: list[Layout]) -> None:
        """Every segment verified, applied and verified again on the GPU; all put back on any failure."""
        self._check_covers(members)
        for m in members:
            self._check_layout(m)
        # a whole version of raw frames (a keyframe): every frame and the version's digest are checked before
        # anything is written, and the writes, copies of checked bytes, need no undo (an undo would be a copy
        # of the whole model, down to the host)
        checked = all(p.manifest.codec == "raw" for p in payloads)
        if checked:
            self._check_raw_version(payloads, members, checksum)
        undo: list = []
        records = []
        try:
            for p, m in zip(payloads, members):
                for j, spec in enumerate(p.manifest.tensors):
                    records.append(self._apply_segment(p, m, j, spec, undo, checked))
            held = state_digest(records)
            if held != checksum:
                raise ChecksumError(f"after applying, the engine's weights digest to {held}, expected {checksum}")
        except BaseException:
            for tensors, how in reversed(undo):
                self._restore(tensors, how)
            self._settle()
            raise
        self._settle()

    def _settle(self) -> None:
        """Wait for the last writes (a scatter may still run): the version is committed, and the engine's next
        forward pass may run on another stream, only once they are in the engine's memory."""
        t = next(iter(self.named.values()))
        with self.rt.stream_of(t):
            self.rt.record_event().synchronize()

    def _check_covers(self, members: list[Layout]) -> None:
        """The version names exactly the engine's tensors (checked once per set of layouts)."""
        key = tuple(m.hash for m in members)
        if key in self._checked:
            return
        check_covers(self.meta, [n for m in members for n in m.names], "version does not cover the engine's "
                     "tensors", mine="engine")
        self._checked.add(key)

    def _check_layout(self, m: Layout) -> None:
        if m.hash in self._checked:
            return
        for i, n in enumerate(m.names):
            tb = self.meta.get(n)
            if tb is None:
                raise MismatchError(f"the version holds {n!r}, which the engine does not")
            dt = m.dtypes[int(np.searchsorted(m.bounds, i, "right")) - 1]
            if tb.shape != m.shapes[i] or tb.dtype.name != dt:
                raise MismatchError(f"{n!r}: the version holds {dt}{list(m.shapes[i])}, the engine "
                                    f"{tb.dtype.name}{list(tb.shape)}")
        self._checked.add(m.hash)

    def _check_raw_version(self, payloads: list, members: list[Layout], checksum: str) -> None:
        specs = [spec for p in payloads for spec in p.manifest.tensors]
        if state_digest((s.name, s.dtype, (s.numel,), s.checksum) for s in specs) != checksum:
            raise ChecksumError(f"the version's segments digest to other than its digest {checksum}")
        for p, m in zip(payloads, members):
            for j, spec in enumerate(p.manifest.tensors):
                if spec.kind != "raw" or spec.checksum != spec.payload_checksum or not self._frame_ok(p, spec):
                    raise ChecksumError(f"{m.describe(j)}: stored bytes do not match their checksum")

    def _frame_ok(self, p, spec) -> bool:
        if p.on_device:
            return self.k.digest_device(p.frame(spec)) == spec.payload_checksum
        return spec.name in p.unpacked or self.host.checksum(p.frame(spec)) == spec.payload_checksum

    def _apply_segment(self, p, m: Layout, j: int, spec, undo: list, checked: bool) -> tuple:
        k = self.k
        dt = dtypes.by_name(spec.dtype)
        tensors = [self.named[n] for n in m.segment_names(j)]
        what = m.describe(j)
        # an all-raw version checked beforehand is written without undo: what the segment held is not read
        with self._staged(tensors, dt, write_back=spec.kind != "same", read=not checked) as seg:
            if p.manifest.codec == "delta" and k.digest_device(seg) != spec.base_checksum:
                raise VersionError(f"base {what} differs from the one this delta was made against "
                                   f"(payload base version {p.manifest.base_version})")
            if spec.kind != "same":
                if not checked and not self._frame_ok(p, spec):
                    raise ChecksumError(f"{what}: stored bytes do not match their checksum")
                undo.append((tensors, self._write(p, spec, seg, dt, what, checked)))
            got = k.digest_device(seg)
            if got != spec.checksum:
                raise ChecksumError(f"{what}: decoded result does not match its checksum")
        return spec.name, spec.dtype, (spec.numel,), got

    def _write(self, p, spec, seg, dt, what: str, checked: bool):
        """Write one segment's new values into seg; returns how to put the old ones back."""
        k = self.k
        parts = p.parts(spec)
        try:
            if p.on_device:
                return self._write_from_device(p, spec, seg, dt, checked)
            if checked:  # raw, and checked with the whole version
                new = np.frombuffer(parts["data"], dt.bits_dtype)
                if len(new) != spec.numel:
                    raise FormatError(f"raw data holds {len(new)} elements, the segment {spec.numel}")
                self._upload(seg, new)
                return ("nothing", None)
            if spec.kind in ("raw", "xor"):
                old = self._read(seg)
                if spec.kind == "raw":
                    new = np.frombuffer(parts["data"], dt.bits_dtype)
                    if len(new) != len(old):
                        raise FormatError(f"raw data holds {len(new)} elements, the segment {len(old)}")
                else:
                    new = old ^ xor_data(spec, parts, dt.bits_dtype)
                self._upload(seg, new)
                return ("whole", old)
            if spec.kind == "delta-v2":
                sec = k.v2_decode_device(seg, parts, dt)
            else:
                sec = p.unpacked.get(spec.name) or CODECS["delta"].unpack(spec, parts, dt)
                self.transfers.add(h2d=sum(np.asarray(a).nbytes for a in (sec.table, sec.gaps, sec.steps, sec.escapes)))
            return ("delta", k.apply_device(seg, sec, dt.order, undo=True))
        except FormatError as e:
            raise FormatError(f"{what}: {e}") from None

    def _write_from_device(self, p, spec, seg, dt, checked: bool):
        """A segment whose frame is in device memory: raw bytes copied over, sparse sections applied."""
        rt, parts = self.rt, p.parts(spec)
        if spec.kind == "raw":
            src = rt.bits(parts["data"], bytes_only=True)
            old = None if checked else self._read(seg)
            with rt.stream_of(seg):
                dst = rt.bits(seg, bytes_only=True)
                if len(src) != len(dst):
                    raise FormatError(f"raw data holds {len(src)} bytes, the segment {len(dst)}")
                dst[...] = src
            return ("nothing" if checked else "whole", old)
        if spec.kind != "delta-sparse":  # the zstd and v2 tiers decode on the host: a device link carries sparse
            raise FormatError(f"a device-memory payload carries raw or delta-sparse segments, not {spec.kind}")
        with rt.stream_of(seg):
            sec = DeltaSections(*(_aligned(rt, parts[name], dtype) for name, dtype in
                                  (("table", "<u4"), ("gaps", "<u2"), ("steps", np.int8), ("escapes", dt.bits_dtype))))
        return ("delta", self.k.apply_device(seg, sec, dt.order, undo=True))

    def _restore(self, tensors: list, how: tuple) -> None:
        kind, saved = how
        if kind == "nothing":
            return
        dt = self.rt.dtype_of(tensors[0])
        with self._staged(tensors, dt, write_back=True) as seg:
            if kind == "whole":
                self._upload(seg, saved)
            else:
                self.k.restore_device(seg, saved)

    def _staged(self, tensors: list, dt, write_back: bool, read: bool = True):
        return _Staged(self.rt, tensors, dt, write_back, read)

    def _read(self, seg) -> np.ndarray:
        with self.rt.stream_of(seg):
            host = self.rt.to_host(self.rt.bits(seg))
        self.transfers.add(d2h=host.nbytes)
        return host

    def _upload(self, seg, host: np.ndarray) -> None:
        rt = self.rt
        with rt.stream_of(seg):
            bits = rt.bits(seg)
            bits[...] = rt.xp.asarray(np.ascontiguousarray(host).view(bits.dtype))
        self.transfers.add(h2d=host.nbytes)


class _Staged:
    """A segment as one contiguous device buffer: the tensor itself when it is alone in its segment, else a
    staging buffer gathered from the tensors (and scattered back on a clean exit, when asked)."""

    def __init__(self, rt, tensors: list, dt, write_back: bool, read: bool = True):
        self.rt, self.tensors, self.dt, self.write_back, self.read = rt, tensors, dt, write_back, read
        self.buf = None

    def __enter__(self):
        rt, ts = self.rt, self.tensors
        if len(ts) == 1:  # the kernels view a contiguous tensor as its flat bits
            self.buf = ts[0]
            return ts[0]
        with rt.stream_of(ts[0]):
            self.buf = rt.empty_tensor(sum(t.numel() for t in ts), self.dt, rt.device_of(ts[0]))
            if self.read:  # a segment about to be overwritten whole needs no copy of what it held
                rt.gather(self.buf, ts)
        return self.buf

    def __exit__(self, exc_type, *exc):
        if exc_type is None and self.write_back and len(self.tensors) > 1:
            with self.rt.stream_of(self.tensors[0]):
                self.rt.scatter(self.buf, self.tensors)
        self.buf = None
        return False


def _aligned(rt, part, dtype):
    """A section of a device body as its own device array of `dtype`: a frame's parts follow each other
    byte by byte, and the kernels read whole elements, which must be aligned."""
    src = rt.bits(part, bytes_only=True)
    dtype = np.dtype(dtype)
    if len(src) % dtype.itemsize:
        raise FormatError(f"a {len(src)}-byte section is not a whole number of {dtype.itemsize}-byte elements")
    out = rt.xp.empty(len(src) // dtype.itemsize, dtype)
    if len(src):
        out.view(np.uint8)[...] = src
    return out


def host_payload(p, transfers: Transfers):
    """A payload whose body is device memory, with its body copied to the host (for an engine that is not on
    the device, or a relay over a host link)."""
    from .payload import Payload

    body = p.body.cpu().numpy() if hasattr(p.body, "cpu") else np.asarray(p.body.data)
    transfers.add(d2h=body.nbytes)
    return Payload(p.manifest, memoryview(body).cast("B"))
