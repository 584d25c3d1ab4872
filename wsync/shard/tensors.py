"""The tensors on either side of a plan: checked against the layouts once, at the public boundary.

A rank handed the wrong tensor (another rank's shard, the full parameter, a
different dtype) would otherwise send or receive well-formed bytes of the
wrong slice; the shapes in the layouts are what catch it, with a message
naming the parameter, what the layout says and what was given.
"""
from __future__ import annotations

from ..errors import MismatchError
from .layout import box_shape


def _torch():
    import torch

    return torch


def local_of(t):
    """A DTensor's local tensor; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _dtype_name(t) -> str:
    """torch's name of t's dtype ("bfloat16"); a device tensor's as the device runtime reads it."""
    from ..device import device_kernels, is_device

    k = device_kernels() if is_device(t) else None
    if k is not None:
        return k.rt.dtype_of(t).torch_name
    return str(t.dtype).removeprefix("torch.")


def buffers_for(plan, pieces) -> dict:
    """One contiguous CPU buffer per piece (piece key -> tensor of the piece's shape and dtype), allocated once."""
    torch = _torch()
    return {p.key: torch.empty(box_shape(p.src), dtype=getattr(torch, plan.trainer.params[p.src_name].dtype))
            for p in pieces}


def trainer_locals(plan, rank: int, given: dict, names) -> dict:
    """given[name] (local tensors) for each of names, checked against the box trainer rank `rank` holds."""
    held = {h.name: h.box for h in plan.trainer.held if h.rank == rank}
    out = {}
    for name in names:
        if name not in given:
            raise MismatchError(f"trainer rank {rank}: publish() was not given {name!r}, which it sends pieces of")
        t = local_of(given[name])
        want, dt = box_shape(held[name]), plan.trainer.params[name].dtype
        if tuple(t.shape) != want or _dtype_name(t) != dt:
            raise MismatchError(f"trainer rank {rank}: {name!r} should be its local shard {dt}{list(want)} "
                                f"(box {held[name]}), got {_dtype_name(t)}{list(t.shape)}")
        out[name] = t
    return out


def engine_locals(plan, rank: int, given: dict) -> dict:
    """given (engine name -> local tensor) checked against what engine rank `rank` declares in the plan."""
    out = {}
    for (r, name), param in plan.engine.locals.items():
        if r != rank:
            continue
        if name not in given:
            raise MismatchError(f"engine rank {rank}: no tensor {name!r}, which the plan writes pieces into")
        t = local_of(given[name])
        if tuple(t.shape) != tuple(param.shape) or _dtype_name(t) != param.dtype:
            raise MismatchError(f"engine rank {rank}: {name!r} should be {param.dtype}{list(param.shape)} "
                                f"(its local tensor), got {_dtype_name(t)}{list(t.shape)}")
        out[name] = t
    return out
