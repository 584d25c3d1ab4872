"""A state as the codecs see it: named tensors reduced to their bit patterns.

Every codec works on flat unsigned-integer views of the tensors (``<u2`` for
bf16/fp16, ``<u4`` for fp32, ...), so they never round and never care which
framework owns the memory. Converting a torch tensor or numpy array costs no
copy when it is contiguous and on the CPU.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from . import dtypes
from .bits import State, TensorBits
from .checkpoint import check_tensor_names, read_checkpoint
from .checksum import state_digest
from .errors import SnapshotError
from .tables import Table


def to_bits(t) -> TensorBits:
    """View a torch tensor or numpy array as TensorBits (no copy when contiguous on CPU)."""
    if isinstance(t, TensorBits):
        return t
    if isinstance(t, np.ndarray):
        dt = dtypes.from_numpy(t.dtype)
        flat = np.ascontiguousarray(t).reshape(-1)
        return TensorBits(dt, tuple(t.shape), flat.view(dt.bits_dtype))
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(t).__name__}")
    dt = dtypes.from_torch(t.dtype)
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    uint = getattr(torch, f"uint{8 * dt.itemsize}")
    return TensorBits(dt, tuple(t.shape), flat.view(uint).numpy())


def to_torch(tb: TensorBits):
    """A torch tensor sharing memory with ``tb.bits`` (copied if read-only)."""
    import torch

    bits = tb.bits if tb.bits.flags.writeable else tb.bits.copy()
    flat = torch.from_numpy(bits)
    return flat.view(getattr(torch, tb.dtype.torch_name)).reshape(tb.shape)


def as_state(obj) -> State:
    """Accept a dict of tensors/arrays, a safetensors file, or a checkpoint folder."""
    if isinstance(obj, (str, os.PathLike)):
        return read_checkpoint(obj).state
    if not isinstance(obj, dict):
        raise TypeError(f"expected a dict of tensors or a path, got {type(obj).__name__}")
    check_tensor_names(obj)  # here, so publish refuses a name no replica could be written with
    if getattr(obj, "bound", False):  # layout.Bound: already TensorBits, with its tables built once
        return obj
    state = {}
    for name, t in obj.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        state[name] = to_bits(t)
    return state


def digest(state: State, checksums: dict[str, str] | None = None) -> str:
    """Digest of a whole state, one entry per tensor (names, dtypes, shapes, contents: see
    checksum.state_digest); the same for any layout, so any two holders of the weights can be compared."""
    checksums = checksums or {n: tb.checksum() for n, tb in state.items()}
    return state_digest((n, tb.dtype.name, tb.shape, checksums[n]) for n, tb in state.items())


def unique_tensors(named: dict) -> dict:
    """Drop later names that alias an earlier tensor's memory (tied weights)."""
    seen, out = set(), {}
    for name, t in named.items():
        key = storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def storage_key(t):
    if hasattr(t, "untyped_storage"):
        return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
    return id(t)


def aliases(t, bits: np.ndarray) -> bool:
    """Is bits a view of t's own memory (a torch tensor, numpy array or TensorBits), so writing one writes the other?"""
    if isinstance(t, TensorBits):
        t = t.bits
    if t is bits:  # the same array, or the same Table of pieces (engines.moe)
        return True
    if isinstance(t, Table) or isinstance(bits, Table):
        return False
    if isinstance(t, np.ndarray):
        return t.size == 0 or np.shares_memory(t, bits)
    return t.device.type == "cpu" and (bits.size == 0 or bits.__array_interface__["data"][0] == t.data_ptr())


def owned_copy(obj, into: State | None = None) -> State:
    """A state the caller can no longer change: bit patterns copied out of its tensors.

    Tied weights (two names on one storage) are kept once, under the first name.
    A GPU tensor is copied to the host once (its .cpu() already is a copy).
    `into`: a state nobody uses any more; arrays of matching dtype and shape are
    reused, which spares the kernel faulting in fresh pages for every copy.
    """
    snap = Copying(obj, into)
    snap.run([list(snap)])
    return snap


class Copying(dict):
    """owned_copy's state, filled in groups of tensors: a reader on another thread waits only for its group.

    Construction converts and plans (a GPU tensor is copied to the host there,
    once); ``run`` then copies group by group. The Publisher's encoder reads
    bucket k while publish() is still copying bucket k+1, so a version's first
    bucket is on the wire before its snapshot is complete.
    """

    def __init__(self, obj, into: State | None = None):
        super().__init__()
        self._jobs: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name -> (source bits, destination)
        self.on_host = True  # every tensor is copied here (none came off a device already copied)
        named = unique_tensors(obj) if isinstance(obj, dict) else None
        for name, t in as_state(named if named is not None else obj).items():
            if named is not None and off_host(named[name]):
                self[name] = t  # as_state already copied it off the device
                self.on_host = False
                continue
            dst = destination(t.bits, (into or {}).get(name))
            self[name] = TensorBits(t.dtype, t.shape, dst)
            self._jobs[name] = (t.bits, dst)
        self._cv = threading.Condition()
        self._pending = set(self._jobs)
        self._error: BaseException | None = None
        self._cached: dict = {}

    def cached(self, key, make):
        """A value computed once per key for this snapshot (its bucket layouts)."""
        if key not in self._cached:
            self._cached[key] = make()
        return self._cached[key]

    def run(self, groups: list[list[str]]) -> None:
        """Copy each group's tensors, in order, waking readers after each group."""
        try:
            for names in groups:
                for name in names:
                    job = self._jobs.pop(name, None)
                    if job is not None:
                        np.copyto(job[1], job[0])
                with self._cv:
                    self._pending.difference_update(names)
                    self._cv.notify_all()
            if self._pending:
                raise ValueError(f"{len(self._pending)} tensors were in no group, e.g. {sorted(self._pending)[0]!r}")
        except BaseException as e:
            with self._cv:
                self._error = e
                self._cv.notify_all()
            raise

    def wait(self, names) -> None:
        """Block until every one of names is copied; SnapshotError if the copying failed."""
        with self._cv:
            while not self._pending.isdisjoint(names):
                if self._error is not None:
                    raise SnapshotError(f"the snapshot was not completed: {self._error!r}") from self._error
                self._cv.wait()


def wait_copied(state: State, names) -> None:
    """For readers of any state: wait for names if it is still being copied (a Copying, or a device state
    whose copies are queued on a GPU stream)."""
    wait = getattr(state, "wait", None)
    if wait is not None:
        wait(names)


def destination(bits: np.ndarray, spare: TensorBits | None) -> np.ndarray:
    if spare is not None and spare.bits.dtype == bits.dtype and spare.bits.shape == bits.shape \
            and spare.bits.flags.writeable:
        return spare.bits
    return np.empty_like(bits)


def off_host(t) -> bool:
    """A device tensor: as_state already copied it to the host."""
    return not isinstance(t, (np.ndarray, TensorBits)) and getattr(t, "device", None) is not None \
        and t.device.type != "cpu"


def blank_like(state: State) -> State:
    """Arrays shaped like state's, their pages already faulted in: a spare for owned_copy(into=...)."""
    out = {}
    for name, tb in state.items():
        bits = np.empty_like(tb.bits)
        bits.fill(0)
        out[name] = TensorBits(tb.dtype, tb.shape, bits)
    return out


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group tensors, in order, into buckets of about bucket_bytes (a bigger tensor gets its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, cur, fill = [], [], 0
    for name, n in sizes:
        if cur and fill + n > bucket_bytes:
            buckets.append(cur)
            cur, fill = [], 0
        cur.append(name)
        fill += n
    if cur:
        buckets.append(cur)
    return buckets
