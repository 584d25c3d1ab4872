"""One place decides which kernels run: WSYNC_BACKEND=auto|ref|cpu|cuda.

A backend is a name mapped to "module:Class", imported only when chosen, so a
machine without a compiler or a GPU never imports what it cannot load.
``wsync.backend()`` reports the choice and, for auto, why the faster ones
were passed over.

The kernels chosen here work on host arrays. ``auto`` never picks ``cuda`` for
them: on host memory the GPU backend can only copy each array up, run, and copy
the result back, which loses to the C++ kernels working where the bytes are.
Device tensors take ``device_kernels()``, the GPU backend's native entry points,
whatever WSYNC_BACKEND says for host work. ``cuda`` may still be asked for by
name (its tests drive the host-array protocol through the GPU on purpose).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from ..errors import BackendUnavailable
from .base import Kernels

REGISTRY = {
    "ref": "wsync.backends.ref:RefKernels",
    "cpu": "wsync.backends.cpu:CpuKernels",
    "cuda": "wsync.backends.cuda:CudaKernels",
}
# For host arrays, fastest first; "auto" takes the first that loads.
AUTO_ORDER = ("cpu", "ref")
DEVICE_BACKEND = "cuda"


@dataclass(frozen=True)
class BackendInfo:
    name: str  # the backend in use
    requested: str  # what WSYNC_BACKEND (or the caller) asked for
    reason: str  # why this one, e.g. "cuda unavailable: no driver"

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


_cache: dict[str, tuple[Kernels, BackendInfo]] = {}


def _load(name: str) -> Kernels:
    if name not in REGISTRY:
        raise BackendUnavailable(f"backend {name!r} is not built into this wsync; available: {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except BackendUnavailable:
        raise
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} cannot load: {e}") from e


DEVICE_NAMES = ("device", "device-body")  # segments in device memory (wsync.device), asked for by the sync code


def select(requested: str | None = None) -> tuple[Kernels, BackendInfo]:
    if requested in DEVICE_NAMES:  # not cached: tests swap the device kernels
        from .device import DeviceKernels

        k = DeviceKernels(device_kernels(), kernels(None), transfers(), keep=requested == "device-body")
        return k, BackendInfo(requested, requested, "device buffers")
    requested = (requested or os.environ.get("WSYNC_BACKEND") or "auto").lower()
    if requested in _cache:
        return _cache[requested]
    if requested != "auto":
        choice = (_load(requested), BackendInfo(requested, requested, "requested"))
    else:
        skipped = []
        for name in AUTO_ORDER:
            try:
                choice = (_load(name), BackendInfo(name, "auto", "; ".join(skipped) or "fastest available"))
                break
            except BackendUnavailable as e:
                skipped.append(f"{name} unavailable: {e}")
    _cache[requested] = choice
    return choice


def kernels(requested: str | None = None) -> Kernels:
    return select(requested)[0]


def backend(requested: str | None = None) -> BackendInfo:
    """Which backend runs the codec kernels, and why."""
    return select(requested)[1]


_device: list = []  # the device backend, once loaded (tests put a simulated runtime's here)
_transfers: list = []


def device_kernels():
    """The GPU backend's kernels for device tensors (CudaKernels); BackendUnavailable where it cannot load
    (found once: a process without cupy or a driver does not look again at every publish)."""
    if not _device:
        try:
            _device.append(_load(DEVICE_BACKEND))
        except BackendUnavailable as e:
            _device.append(str(e))
    if isinstance(_device[0], str):
        raise BackendUnavailable(_device[0])
    return _device[0]


def use_device_kernels(k) -> None:
    """Run device tensors through `k` (a CudaKernels over another runtime: the CPU harness in tests)."""
    _device[:] = [k] if k is not None else []


def transfers():
    """This process's count of bytes wsync copied between device and host memory (device.Transfers)."""
    if not _transfers:
        from .device import Transfers

        _transfers.append(Transfers())
    return _transfers[0]
