"""CUDA IPC for local://: a colocated engine gets the trainer's GPU memory itself, not a copy.

A CUDA tensor given as a blob is described by torch's IPC handle for its
storage (``UntypedStorage._share_cuda_``), written as plain JSON (bytes as
hex), never pickled; the reader opens it with ``_new_shared_cuda`` and gets a
flat uint8 CUDA tensor over the same bytes. Nothing is copied, so nothing is
checksummed here: the sync layer's digest of what the engine holds covers it.

Which GPU: the description names the GPU by its UUID as well as the writer's
ordinal, because ordinals depend on each process's CUDA_VISIBLE_DEVICES (Ray and
verl set it per actor); the reader maps the UUID to its own ordinal.

Ordering: ``_share_cuda_`` records an interprocess event on the *calling
thread's* current stream of the tensor's device (or, once torch runs short of
IPC events, synchronizes that stream), and ``_new_shared_cuda`` makes the
reader thread's current stream of that device wait for it. So the writer's
bytes must be complete on its current stream when it sends (work queued on
another stream must be joined first, e.g. ``torch.cuda.current_stream().wait_stream(s)``),
and the reader must use the tensor on its current stream at recv, or join it.

Lifetime: torch's IPC reference counter keeps the allocation alive while the
reader holds it, but not its bytes unchanged; the link tells the writer when
the reader let go of a message (see local.LocalLink.wait_cuda_released).
"""
from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Sequence

from ..errors import TransportError

_TOKEN = secrets.token_hex(8)  # with the pid, tells this process apart from one with the same pid in another namespace


def _process() -> str:
    return f"{os.getpid()}-{_TOKEN}"  # a forked child has a new pid, a spawned one a new token


def is_cuda(blob) -> bool:
    return getattr(blob, "is_cuda", False) is True


def check(t) -> None:
    """Raise before anything is shared: a share that is never opened holds the writer's allocation for good."""
    if not t.is_contiguous():
        raise ValueError("a CUDA blob must be contiguous; call .contiguous() first")


@functools.lru_cache(maxsize=None)
def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


@functools.lru_cache(maxsize=1)
def visible_uuids() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees, by ordinal (fixed once CUDA is initialised)."""
    import torch

    return tuple(device_uuid(i) for i in range(torch.cuda.device_count()))


def _norm(uuid: str) -> str:
    u = str(uuid).strip().lower()
    return u[4:] if u.startswith("gpu-") else u  # nvidia-smi and CUDA_VISIBLE_DEVICES spell it GPU-<uuid>


def reader_device(uuid: str, writer_ordinal: int, visible: Sequence[str]) -> int:
    """This process's ordinal for the GPU the writer called writer_ordinal and identified by uuid."""
    found = [i for i, u in enumerate(visible) if _norm(u) == _norm(uuid)]
    if len(found) == 1:
        return found[0]
    if found:
        raise TransportError(f"GPU {uuid} (the writer's cuda:{writer_ordinal}) matches several GPUs here "
                             f"(ordinals {found}); cannot tell which one holds the shared memory")
    seen = ", ".join(f"cuda:{i}={u}" for i, u in enumerate(visible)) or "none"
    raise TransportError(f"the shared CUDA memory is on GPU {uuid} (the writer's cuda:{writer_ordinal}), which this "
                         f"process cannot see (it sees: {seen}); make that GPU visible here, e.g. in CUDA_VISIBLE_DEVICES")


def share(t) -> dict:
    """JSON description of t's bytes for open_shared in another process on this host.

    The caller keeps t alive and unchanged until the reader has let go of it.
    """
    check(t)
    ordinal = t.device.index
    d = {"uuid": device_uuid(ordinal), "device": int(ordinal), "proc": _process(),
         "offset": t.storage_offset() * t.element_size(), "nbytes": t.numel() * t.element_size()}
    if d["nbytes"] == 0:
        return d  # an empty storage has no allocation and so no handle; the reader makes an empty tensor
    try:
        st = t.detach().untyped_storage()
        device, handle, size, offset, ref_handle, ref_offset, event, event_sync = st._share_cuda_()
    except RuntimeError as e:
        raise TransportError(f"could not share CUDA memory on cuda:{ordinal} for another process: {e}") from None
    d.update({"handle": bytes(handle).hex(), "storage_size": int(size), "storage_offset": int(offset),
              "ref_handle": bytes(ref_handle).hex(), "ref_offset": int(ref_offset),
              "event": bytes(event).hex(), "event_sync": bool(event_sync)})
    return d


def _ints(d: dict, *keys: str) -> list[int]:
    out = [d[k] for k in keys]
    if not all(type(v) is int and v >= 0 for v in out):
        raise ValueError(f"CUDA description fields {keys} must be non-negative integers, got {out}")
    return out


def open_shared(d: dict):
    """A flat uint8 CUDA tensor over the memory d describes, on this process's ordinal for that GPU.

    Raises TransportError when it cannot be opened here; ValueError/KeyError when d is malformed.
    """
    import torch

    if not isinstance(d, dict):
        raise ValueError(f"a CUDA description must be a JSON object, got {type(d).__name__}")
    if d.get("proc") == _process():
        raise TransportError("CUDA IPC cannot open memory in the process that shared it; "
                             "colocated links within one process must pass host blobs")
    writer_ordinal, offset, nbytes = _ints(d, "device", "offset", "nbytes")
    try:
        # _new_shared_cuda indexes the caching allocator's per-device state, which only torch's lazy CUDA init
        # creates; a fresh reader process has not run it yet (torch's rebuild_cuda_tensor calls it for the same reason)
        torch.cuda.init()
        visible = visible_uuids()
    except (RuntimeError, AssertionError) as e:  # no driver, no GPU, or a torch built without CUDA
        raise TransportError(f"CUDA is not usable in this process, so shared GPU memory cannot be opened: {e}") from None
    ordinal = reader_device(d["uuid"], writer_ordinal, visible)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", ordinal))
    storage_size, storage_offset, ref_offset = _ints(d, "storage_size", "storage_offset", "ref_offset")
    if offset + nbytes > storage_size:
        raise ValueError(f"CUDA description reaches past its storage ({offset} + {nbytes} > {storage_size})")
    args = (ordinal, bytes.fromhex(d["handle"]), storage_size, storage_offset,
            bytes.fromhex(d["ref_handle"]), ref_offset, bytes.fromhex(d["event"]), bool(d["event_sync"]))
    try:
        # No cache of opened storages, unlike rebuild_cuda_tensor: torch's allocator already maps each handle once
        # per process, and a cache hit would skip this message's event wait and tie its release to an older message.
        st = torch.UntypedStorage._new_shared_cuda(*args)
        out = torch.empty(0, dtype=torch.uint8, device=st.device)
        return out.set_(st, offset, (nbytes,), (1,))
    except RuntimeError as e:
        st = out = None  # the raised error keeps this frame: it must not keep the mapping
        raise TransportError(
            f"could not open CUDA memory shared by process {str(d.get('proc')).split('-')[0]} on GPU {d['uuid']} "
            f"(cuda:{ordinal} here): {e}. CUDA IPC needs both processes on this host with that GPU visible, a "
            f"container that allows it, and, under expandable_segments, ptrace permission over the writer") from None


def watch(t):
    """A weak reference to t's storage: expired() once nothing in this process holds those bytes any more."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())
