"""CUDA IPC for local://: a colocated engine gets the trainer's GPU memory itself, not a copy.

A CUDA tensor given as a blob is described by torch's IPC handle for its
storage (``UntypedStorage._share_cuda_``), written as plain JSON (bytes as
hex), never pickled; the reader opens it with ``_new_shared_cuda`` and gets a
flat uint8 CUDA tensor over the same bytes. Nothing is copied, so nothing is
checksummed here: the sync layer's digest of what the engine holds covers it.
The writer must keep the tensor alive and unchanged until the reader is done
(torch's IPC reference counter keeps the allocation itself alive).
"""
from __future__ import annotations


def is_cuda(blob) -> bool:
    return getattr(blob, "is_cuda", False) is True


def share(t) -> dict:
    if not t.is_contiguous():
        raise ValueError("a CUDA blob must be contiguous; call .contiguous() first")
    st = t.detach().untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, event_sync = st._share_cuda_()
    return {"device": int(device), "handle": bytes(handle).hex(), "storage_size": int(size),
            "storage_offset": int(offset), "ref_handle": bytes(ref_handle).hex(), "ref_offset": int(ref_offset),
            "event": bytes(event).hex(), "event_sync": bool(event_sync),
            "offset": t.storage_offset() * t.element_size(), "nbytes": t.numel() * t.element_size()}


def open_shared(d: dict):
    import torch

    st = torch.UntypedStorage._new_shared_cuda(
        d["device"], bytes.fromhex(d["handle"]), d["storage_size"], d["storage_offset"],
        bytes.fromhex(d["ref_handle"]), d["ref_offset"], bytes.fromhex(d["event"]), d["event_sync"])
    out = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", d["device"]))
    return out.set_(st, d["offset"], (d["nbytes"],), (1,))
