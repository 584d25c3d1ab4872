"""``gloo://host:port?world_size=N`` and ``nccl://...``: one broadcast group over torch.distributed.

The group lives on **its own** process groups, built straight from a private
TCPStore at host:port (rank 0, the publisher, hosts it). Nothing is registered
with torch's default group or its group table, so a trainer's own
``init_process_group`` world, before or after, never sees or collides with ours.

The publisher's ``listen(...).accept()`` returns ONE Link for the whole group
(``fanout = world_size - 1``); a subscriber's ``connect`` returns its Link to the
publisher. Publisher ``send`` is a broadcast; subscriber ``send`` followed by the
publisher's ``recv`` (once per subscriber, each with ``meta["rank"]``) is a
gather. Every message starts with an allgather of (direction, header length,
sequence) from every rank, so a group that is out of step (two senders, a
missed message) fails loudly instead of mixing bytes. **The group is lockstep**:
all ranks take part in every message, and publisher and subscribers alternate
(hello -> versions -> acks), which is how the sync protocol talks anyway.

Control (that allgather, headers, digest trailers) always runs on a gloo group
with CPU tensors; payload pieces run on the same gloo group, or on an NCCL group
through GPU buffers. So an idle subscriber waits in a CPU collective (its
timeout is enforced by waiting on the Work, which leaves it pending and
resumable) and NCCL only ever sees operations both sides have committed to.
"""
from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass

from ..errors import BackendUnavailable, TransportError
from . import groupframe as gf
from . import options
from .base import Address
from .grouplink import GroupLink

FOREVER = datetime.timedelta(days=3650)  # gloo's own op timeout: we bound every wait ourselves


@dataclass(kw_only=True)
class GroupConfig:
    world_size: int = 0  # ranks in the group: publisher + subscribers; a subscriber may omit it (read from the store)
    rank: int | None = None  # a subscriber's rank in 1..world_size-1; None takes the next free one
    chunk: int = 64 << 20  # bytes per collective; loopback gloo peaks at >= 64M, smaller pieces lose ~20%
    join_timeout: float = 300.0  # seconds for the store to be reached and the group to form
    stall_timeout: float = 120.0  # once a message has started, longest wait for any of its parts
    device: str | None = None  # nccl: CUDA device of the wire buffers (default: the current device)
    pool_bytes: int = 1 << 30  # received buffers kept for reuse once released (fresh pages cost ~1 GB/s)
    bind: str | None = None  # gloo: local IP to bind; default 127.0.0.1 for a loopback store, else the hostname's


KINDS = {"world_size": int, "rank": int, "chunk": "size", "pool_bytes": "size", "join_timeout": float, "stall_timeout": float}


def _config(addr: Address, opts: dict) -> GroupConfig:
    cfg = options.build(GroupConfig, addr.params, opts, KINDS)
    if cfg.chunk < 1:
        raise ValueError(f"chunk must be at least 1 byte, got {cfg.chunk}")
    return cfg


def _dist():
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise BackendUnavailable(f"gloo:// and nccl:// need torch with torch.distributed ({e}); "
                                 "install it with: pip install 'wsync[torch]'") from None
    if not dist.is_available():
        raise BackendUnavailable("this torch build has no torch.distributed; gloo:// and nccl:// cannot run")
    return dist


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def listen(addr: Address, **opts) -> "GroupListener":
    return GroupListener(addr, _config(addr, opts))


def connect(addr: Address, **opts) -> "GroupLink":
    """Join the group as a subscriber; returns once every rank has joined."""
    cfg, dist = _config(addr, opts), _dist()
    try:
        store = dist.TCPStore(addr.host, addr.port, None, False, timeout=_seconds(cfg.join_timeout))
        size = int(store.get("world_size"))
    except RuntimeError as e:
        raise TransportError(f"cannot reach the {addr.scheme} group store at {addr.host}:{addr.port}: {_first_line(e)}") from None
    if cfg.world_size and cfg.world_size != size:
        raise TransportError(f"this subscriber says world_size={cfg.world_size} but the publisher's group has {size}")
    rank = _claim_rank(store, size, cfg.rank)
    if store.add("joined", 1) == size - 1:
        store.set("all_joined", "1")
    return _make_link(addr, cfg, store, rank, size, f"{addr.scheme} publisher {addr.host}:{addr.port}")


def _claim_rank(store, size: int, wanted: int | None) -> int:
    token = secrets.token_hex(8)  # compare_set returns the winner's value; ours is unique
    if wanted is not None:
        if not 1 <= wanted < size:
            raise ValueError(f"a subscriber's rank must be in 1..{size - 1}, got {wanted}")
        if store.compare_set(f"rank/{wanted}", "", token).decode() != token:
            raise TransportError(f"rank {wanted} is already taken in this group; give each subscriber its own rank")
        return wanted
    while (r := store.add("next_rank", 1)) < size:
        if store.compare_set(f"rank/{r}", "", token).decode() == token:
            return r
    raise TransportError(f"the group is full: all {size - 1} subscriber ranks are taken")


class GroupListener:
    """Hosts the group's store; accept() returns the group Link once all world_size - 1 subscribers joined."""

    def __init__(self, addr: Address, cfg: GroupConfig):
        dist = _dist()
        if cfg.world_size < 2:
            raise ValueError(f"{addr.scheme}:// needs world_size >= 2 (publisher + subscribers), got {cfg.world_size}")
        self.addr, self.cfg, self._formed = addr, cfg, False
        try:
            self.store = dist.TCPStore(addr.host, addr.port, cfg.world_size, True,
                                       timeout=_seconds(cfg.join_timeout), wait_for_workers=False)
        except RuntimeError as e:
            raise TransportError(f"cannot host the group store on {addr.host}:{addr.port}: {_first_line(e)}") from None
        self.store.set("world_size", str(cfg.world_size))
        self.address = str(Address(addr.scheme, addr.host, self.store.port, "", addr.params))

    def accept(self, timeout: float | None = None) -> "GroupLink | None":
        if self._formed:  # one group per listener: nobody else can join it
            return None
        while True:
            try:
                self.store.wait(["all_joined"], _seconds(timeout if timeout is not None else 3600))
                break
            except RuntimeError:
                if timeout is not None:
                    return None
        self._formed = True
        a = self.addr
        return _make_link(a, self.cfg, self.store, 0, self.cfg.world_size,
                          f"{a.scheme} group {a.host}:{self.store.port} ({self.cfg.world_size - 1} subscribers)")

    def close(self) -> None:
        self.store = None  # a formed link keeps its own reference


def _make_link(addr: Address, cfg: GroupConfig, store, rank: int, size: int, peer: str) -> "GroupLink":
    dist = _dist()
    base = dist.PrefixStore("wsync", store)
    try:
        gopts = dist.ProcessGroupGloo._Options()
        gopts._timeout = _seconds(cfg.join_timeout)
        gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=_bind(addr, cfg))]
        ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", base), rank, size, gopts)
        ctrl._set_default_timeout(FOREVER)
        data, wire = ctrl, gf.HostWire()
        if addr.scheme == "nccl":
            data, wire = _nccl_group(dist, dist.PrefixStore("data", base), rank, size, cfg)
    except RuntimeError as e:
        raise TransportError(f"forming the {addr.scheme} group (rank {rank} of {size}) failed: {_first_line(e)}") from None
    return GroupLink(ctrl=ctrl, data=data, wire=wire, rank=rank, size=size, cfg=cfg, peer=peer, store=store)


def _bind(addr: Address, cfg: GroupConfig) -> str:
    if cfg.bind:
        return cfg.bind
    import socket

    loop = addr.host in ("localhost", "127.0.0.1", "::1") or addr.host.startswith("127.")
    return "127.0.0.1" if loop else socket.gethostname()


def _nccl_group(dist, store, rank: int, size: int, cfg: GroupConfig):
    import torch

    if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
        raise BackendUnavailable("nccl:// needs a CUDA build of torch and a GPU; use gloo:// on CPU")
    device = torch.device(cfg.device or f"cuda:{torch.cuda.current_device()}")
    nopts = dist.ProcessGroupNCCL.Options()
    nopts._timeout = _seconds(max(cfg.stall_timeout, cfg.join_timeout))
    return dist.ProcessGroupNCCL(store, rank, size, nopts), gf.CudaWire(device, cfg.chunk)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
