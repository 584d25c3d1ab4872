"""Kernels for segments that live in device memory, and the count of bytes that cross to the host.

wsync.device keeps a version's segments in device buffers; wsync.api encodes
them through the same calls as host arrays. These answer those calls with the
GPU backend's device entry points: changes and checksums are computed on the
GPU, and only what a payload must carry on the host (the sections, a dense
change, a raw segment) is copied over, once, and counted.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..codecs.delta_ref import DeltaSections
from ..tables import byte_size


def is_device(t) -> bool:
    """A CUDA tensor (torch's, or anything that says it is one)."""
    return getattr(t, "is_cuda", False) is True


@dataclass
class Transfers:
    """Bytes copied between device and host, by direction (what a host link forces across PCIe)."""

    d2h: int = 0
    h2d: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, d2h: int = 0, h2d: int = 0) -> None:
        with self._lock:
            self.d2h += d2h
            self.h2d += h2d


class DeviceKernels:
    """The Kernels calls wsync.api makes to encode, on segments that are device buffers.

    Changes and checksums are computed on the GPU; what a payload must carry on
    the host (the sections, a dense change, a raw segment) is copied once and
    counted. Host arrays (a payload's frames) go to the host kernels.
    """

    name = "device"

    def __init__(self, k, host, transfers: Transfers, keep: bool = False):
        self.k, self.rt, self.host, self.transfers = k, k.rt, host, transfers
        # keep: a payload whose body stays on the device (for a link that carries device memory): sections
        # stay where they were built and assemble() lays the frames out in a device buffer
        self.keep = keep

    def delta_encode_checksummed(self, old, new, order: str, old_sum: bool = True):
        sec = self.k.encode_device(old, new, order)
        sums = self.k.digests_device([old, new] if old_sum else [new])
        sec = sec if self.keep else self._to_host(sec, new)
        return sec, (sums[0] if old_sum else None), sums[-1]

    def assemble(self, encoded: list, keys: list[str]):
        """Every segment's frame laid out in one device buffer, each checksummed on the GPU, with no host copy
        of a device part (host parts, a zstd stage's output, go up once). Returns (body, [(key, offset,
        lengths, frame checksum)]). wsync.api._assemble's layout, where the body is a device tensor."""
        parts = [list(enc.parts.items()) for *_, enc in encoded]
        lengths = [{p: byte_size(v) for p, v in ps} for ps in parts]
        total = sum(sum(ls.values()) for ls in lengths)
        like = encoded[0][0].bits  # the first segment's buffer: the body goes on its device
        rt = self.rt
        with rt.stream_of(like):
            body = rt.empty_tensor(total, dtypes.by_name("U8"), rt.device_of(like))
            flat = rt.bits(body, bytes_only=True)
            out, at = [], 0
            for key, ps, ls in zip(keys, parts, lengths):
                start = at
                for p, v in ps:
                    if ls[p]:
                        flat[at : at + ls[p]] = self._device_bytes(v)
                    at += ls[p]
                frame_sum = self.k.launcher.digests([flat[start:at]])[0]
                out.append((key, start, ls, frame_sum))
        return body, out

    def _device_bytes(self, v):
        """v (a device array, a device tensor, or host bytes) as device u8, for a copy into a device body."""
        if is_device(v):
            return self.rt.bits(v, bytes_only=True)
        if hasattr(v, "__cuda_array_interface__"):
            return v.view(np.uint8)
        host = np.frombuffer(v, np.uint8)
        self.transfers.add(h2d=host.nbytes)
        return self.rt.xp.asarray(host)

    def checksum(self, buf) -> str:
        return self.k.digest_device(buf) if is_device(buf) else self.host.checksum(buf)

    def copy_checksummed(self, src, dst: np.ndarray) -> str:
        if not is_device(src):
            return self.host.copy_checksummed(src, dst)
        s = self.k.digest_device(src)
        dst.view(np.uint8)[:] = self._read(src).view(np.uint8)
        return s

    def xor(self, a, b) -> np.ndarray:
        """a ^ b of two device buffers, on the host (a dense change: zstd packs it there)."""
        with self.rt.stream_of(b):
            x = self.rt.bits(a) ^ self.rt.bits(b)
            return self._counted(self.rt.to_host(x))

    def v2_encode(self, old, sec: DeltaSections, dtype) -> dict:
        """v2 models the changes with the base as context, and its encoder runs on the host: the base crosses."""
        return self.host.v2_encode(self._read(old), sec, dtype)

    def _read(self, t) -> np.ndarray:
        with self.rt.stream_of(t):
            return self._counted(self.rt.to_host(self.rt.bits(t)))

    def _to_host(self, sec, like) -> DeltaSections:
        from .cuda import sections_to_host

        host = sections_to_host(sec, np.dtype(f"<u{like.element_size()}"))
        self.transfers.add(d2h=sum(a.nbytes for a in (host.table, host.gaps, host.steps, host.escapes)))
        return host

    def _counted(self, a: np.ndarray) -> np.ndarray:
        self.transfers.add(d2h=a.nbytes)
        return a
