"""``gloo://host:port?world_size=N`` and ``nccl://...``: one broadcast group over torch.distributed.

The group lives on **its own** process groups, built straight from a private
TCPStore at host:port (rank 0, the publisher, hosts it). Nothing is registered
with torch's default group or its group table, so a trainer's own
``init_process_group`` world, before or after, never sees or collides with ours.

The publisher's ``listen(...).accept()`` returns ONE Link for the whole group
(``fanout = world_size - 1``); a subscriber's ``connect`` returns its Link to the
publisher. The listener forms groups in **generations** on the one store: once a
group forms, the next subscribers to dial join the next generation, which forms
(a new Link from ``accept``) when world_size - 1 of them have joined. So a
subscriber that lost its group (a member died, the group fell out of step)
redials the same address and forms a new group with the publisher, and with
``world_size=2`` every subscriber gets a group of its own: point to point, as
tcp is, over gloo or NCCL. A join that does not form within ``join_timeout``
abandons its generation, so one that died half-way blocks nobody for good. Publisher ``send`` is a broadcast; subscriber ``send`` followed by the
publisher's ``recv`` (once per subscriber, each with ``meta["rank"]``) is a
gather. Every message starts with an allgather of (direction, header length,
sequence) from every rank, so a group that is out of step (two senders, a
missed message) fails loudly instead of mixing bytes. **The group is lockstep**:
all ranks take part in every message, and publisher and subscribers alternate
(hello -> versions -> acks), which is how the sync protocol talks anyway.

Control (that allgather, headers, digest trailers) always runs on a gloo group
with CPU tensors; payload pieces run on the same gloo group, or on an NCCL group
in GPU memory: CUDA tensor blobs on the group's device go as they are, host
blobs through GPU staging buffers. So an idle subscriber waits in a CPU
collective (its timeout is enforced by waiting on the Work, which leaves it
pending and resumable) and NCCL only ever sees operations both sides have
committed to.

An NCCL group is bound to one device per rank: the ``device`` option, else the
device current on the thread that called ``listen`` or ``connect``, read there
and then. The group is formed on the thread that calls ``accept`` (or inside
``connect``) and used from whichever threads send and receive; each of them makes
that device current first, since a new thread starts on device 0 (which would put
every rank's communicator and buffers on GPU 0).
"""
from __future__ import annotations

import datetime
import secrets
import time
from dataclasses import dataclass

from ..errors import BackendUnavailable, TransportError
from . import groupframe as gf
from . import options
from .base import Address, current_device
from .grouplink import GroupLink

FOREVER = datetime.timedelta(days=3650)  # gloo's own op timeout: we bound every wait ourselves


@dataclass(kw_only=True)
class GroupConfig:
    world_size: int = 0  # ranks in the group: publisher + subscribers; a subscriber may omit it (read from the store)
    rank: int | None = None  # a subscriber's rank in 1..world_size-1; None takes the next free one
    chunk: int = 64 << 20  # bytes per collective: large, so each operation's fixed cost is spread over many bytes
    join_timeout: float = 300.0  # seconds for the store to be reached and the group to form
    stall_timeout: float = 120.0  # once a message has started, longest wait for any of its parts
    device: str | None = None  # nccl: this rank's GPU (default: the one current where listen/connect was called)
    pool_bytes: int = 1 << 30  # received buffers kept for reuse once released (fresh pages are slow: see pool.py)
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
    """Join the group as a subscriber; returns once every rank of this generation has joined."""
    cfg, dist = _config(addr, opts), _dist()
    device = _link_device(dist, addr, cfg)
    try:
        store = dist.TCPStore(addr.host, addr.port, None, False, timeout=_seconds(cfg.join_timeout))
        size = int(store.get("world_size"))
    except RuntimeError as e:
        raise TransportError(f"cannot reach the {addr.scheme} group store at {addr.host}:{addr.port}: {_first_line(e)}") from None
    if cfg.world_size and cfg.world_size != size:
        raise TransportError(f"this subscriber says world_size={cfg.world_size} but the publisher's group has {size}")
    gen, rank = _claim(store, size, cfg.rank)
    if store.add(f"g{gen}/joined", 1) == size - 1:
        store.set(f"g{gen}/all_joined", "1")
    try:
        return _make_link(addr, cfg, store, gen, rank, size, f"{addr.scheme} publisher {addr.host}:{addr.port}", device)
    except TransportError:
        _settle(store, gen, "abandoned")  # the next dial, ours or another's, starts a fresh generation
        raise


def _claim(store, size: int, wanted: int | None) -> tuple[int, int]:
    """(generation, rank): a rank in the generation now forming; if the publisher formed that one meanwhile,
    in the next."""
    for _ in range(100):
        gen = int(store.get("gen"))
        try:
            return gen, _claim_rank(store, f"g{gen}/", size, wanted)
        except TransportError:
            if int(store.get("gen")) != gen:
                continue  # formed (or abandoned) meanwhile: try the next one
            if not store.check([f"g{gen}/all_joined"]):
                raise  # still forming, and the rank (or every rank) is taken
            time.sleep(0.05)  # complete: the publisher is about to form it and open the next
    raise TransportError("the group's generations moved on 100 times while this subscriber tried to join")


def _settle(store, gen: int, fate: str) -> bool:
    """Decide generation gen's fate once ("formed" by the publisher, or "abandoned" by a subscriber whose join
    failed) and move "gen" past it; True if this call decided it."""
    won = store.compare_set(f"g{gen}/fate", "", fate).decode() == fate
    store.compare_set("gen", str(gen), str(gen + 1))
    return won


def _claim_rank(store, prefix: str, size: int, wanted: int | None) -> int:
    token = secrets.token_hex(8)  # compare_set returns the winner's value; ours is unique
    if wanted is not None:
        if not 1 <= wanted < size:
            raise ValueError(f"a subscriber's rank must be in 1..{size - 1}, got {wanted}")
        if store.compare_set(f"{prefix}rank/{wanted}", "", token).decode() != token:
            raise TransportError(f"rank {wanted} is already taken in this group; give each subscriber its own rank")
        return wanted
    while (r := store.add(f"{prefix}next_rank", 1)) < size:
        if store.compare_set(f"{prefix}rank/{r}", "", token).decode() == token:
            return r
    raise TransportError(f"the group is full: all {size - 1} subscriber ranks are taken")


class GroupListener:
    """Hosts the groups' store; accept() returns a group's Link once world_size - 1 subscribers joined it."""

    def __init__(self, addr: Address, cfg: GroupConfig):
        dist = _dist()
        if cfg.world_size < 2:
            raise ValueError(f"{addr.scheme}:// needs world_size >= 2 (publisher + subscribers), got {cfg.world_size}")
        self.addr, self.cfg = addr, cfg
        self.device = _link_device(dist, addr, cfg)  # here, on the caller's thread: accept() may run on any other
        try:
            self.store = dist.TCPStore(addr.host, addr.port, cfg.world_size, True,
                                       timeout=_seconds(cfg.join_timeout), wait_for_workers=False)
        except RuntimeError as e:
            raise TransportError(f"cannot host the group store on {addr.host}:{addr.port}: {_first_line(e)}") from None
        self.store.set("world_size", str(cfg.world_size))
        self.store.set("gen", "0")
        self.address = str(Address(addr.scheme, addr.host, self.store.port, "", addr.params))

    def accept(self, timeout: float | None = None) -> "GroupLink | None":
        """The next group to form (None if none did within timeout); waits forever with timeout None."""
        store = self.store
        if store is None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # polled with check: a store.wait that times out logs a warning from c10d every time
            gen = int(store.get("gen"))  # a subscriber may have abandoned it since the last look
            if store.check([f"g{gen}/all_joined"]):
                break
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        if not _settle(store, gen, "formed"):
            return None  # abandoned while we looked: its members redial into the next one
        a = self.addr
        try:
            return _make_link(a, self.cfg, store, gen, 0, self.cfg.world_size,
                              f"{a.scheme} group {a.host}:{store.port}#{gen} ({self.cfg.world_size - 1} subscribers)",
                              self.device)
        except TransportError:
            return None  # a member died before the group formed; it redials into the next generation

    def close(self) -> None:
        self.store = None  # a formed link keeps its own reference


def _make_link(addr: Address, cfg: GroupConfig, store, gen: int, rank: int, size: int, peer: str,
               device=None) -> "GroupLink":
    dist = _dist()
    base = dist.PrefixStore(f"wsync/g{gen}", store)
    try:
        gopts = dist.ProcessGroupGloo._Options()
        gopts._timeout = _seconds(cfg.join_timeout)
        gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=_bind(addr, cfg))]
        ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", base), rank, size, gopts)
        ctrl._set_default_timeout(FOREVER)
        data, wire = ctrl, gf.HostWire()
        if addr.scheme == "nccl":
            data, wire = _nccl_group(dist, dist.PrefixStore("data", base), rank, size, cfg, device)
    except RuntimeError as e:
        raise TransportError(f"forming the {addr.scheme} group (rank {rank} of {size}) failed: {_first_line(e)}") from None
    return GroupLink(ctrl=ctrl, data=data, wire=wire, rank=rank, size=size, cfg=cfg, peer=peer, store=store,
                     device=device)


def _bind(addr: Address, cfg: GroupConfig) -> str:
    if cfg.bind:
        return cfg.bind
    import socket

    loop = addr.host in ("localhost", "127.0.0.1", "::1") or addr.host.startswith("127.")
    return "127.0.0.1" if loop else socket.gethostname()


def _link_device(dist, addr: Address, cfg: GroupConfig):
    """nccl: this rank's CUDA device, from the option or the calling thread's current device; None for gloo."""
    if addr.scheme != "nccl":
        return None
    import torch

    if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
        raise BackendUnavailable("nccl:// needs a CUDA build of torch and a GPU; use gloo:// on CPU")
    return gf.choose_device(cfg.device, current_device())


def _nccl_group(dist, store, rank: int, size: int, cfg: GroupConfig, device):
    """The NCCL group and its wire, bound to device.

    torch's init_process_group and new_group take device_id=, but they register the group in torch's global
    table, which this module stays out of; what device_id does there for NCCL is done here: the communicator
    is formed at once on that device (eager_connect_single_device, where this torch and NCCL can split, as
    torch itself requires), rather than at the first operation on whatever thread posts it."""
    import torch

    nopts = dist.ProcessGroupNCCL.Options()
    nopts._timeout = _seconds(max(cfg.stall_timeout, cfg.join_timeout))
    with torch.cuda.device(device):  # this runs on the accept thread, or the thread that called connect
        pg = dist.ProcessGroupNCCL(store, rank, size, nopts)
        if pg.supports_splitting:
            pg.eager_connect_single_device(device)
        return pg, gf.CudaWire(device, cfg.chunk)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
