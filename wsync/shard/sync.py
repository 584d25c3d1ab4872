"""Sharded trainer ranks into sharded engine ranks: each trainer rank sends only its pieces, point to point.

    plan = route(trainer_layout, engine_layout)                   # once per layout pair
    # trainer rank t (rank 0 may host the coordinator; or run a Coordinator anywhere)
    pub = ShardPublisher(plan, t, coordinator="tcp://trainer0:7071", host_coordinator=(t == 0), token=...)
    pub.publish({name: p.to_local() for name, p in model.named_parameters()}, version=step)
    # engine rank r
    sub = ShardSubscriber(plan, r, {name: p for name, p in tp_model.named_parameters()},
                          coordinator="tcp://trainer0:7071", token=...)
    sub.wait_for(step)                                            # every engine rank serves step, or none does

Trainer side: one wsync Publisher per engine rank this trainer rank sends to,
whose state is that engine rank's pieces (piece key -> the slice of this
rank's local tensor, copied into a buffer of its own, allocated once). A
Publisher per destination rather than one per trainer rank because a
Publisher sends its whole state to every subscriber: per destination, each
engine rank gets exactly its pieces, and deltas, keyframes, catch-up and
per-version checksums come from the existing protocol per (trainer, engine)
pair. So a trainer rank never holds or sends bytes of a parameter it does not
own: its buffers are its pieces, and its Publishers' states are those buffers.

Engine side: see stage.py (staging per source) and commit.py (the rounds).
"""
from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass

from .. import backends
from .. import dtypes
from ..device import on_one_device
from ..layout import bind
from ..quant import as_quantizer
from ..sync import Publisher
from . import streams
from .commit import Coordinator, SettleTimeout
from .engine import ShardSubscriber  # the engine side: one module to import
from .layout import box_numel, box_shape, full_box
from .member import Member, digests_doc
from .quantized import LocalQuantizer
from .rounds import partial_digest
from .stage import GROUPS, _slices, data_token
from .tensors import buffers_for, trainer_locals

__all__ = ["ShardPublisher", "ShardPublisherStats", "ShardSubscriber", "SettleTimeout", "TRANSPORTS"]
log = logging.getLogger("wsync.shard")

TRANSPORTS = ("tcp", "ucx", "local", "gloo", "nccl")  # what a (trainer, engine) pair's Publisher may listen on


@dataclass(frozen=True, kw_only=True)
class ShardPublisherStats:
    """A trainer rank's counters at one moment (ShardPublisher.stats).

    pieces: the slices it sends each version, to every engine rank together. piece_bytes: their bytes, what it
    sends per version at most and the buffers it allocated for them. bytes: version -> encoded bytes its
    Publishers made of it (every destination together)."""

    pieces: int
    piece_bytes: int
    bytes: dict[int, int]


def data_address(transport: str, host: str, tag: str | None) -> str:
    """The address a pair's Publisher listens on (tag None: check the transport once, and warn, per trainer rank).

    tcp://host:0, ucx://host:0 and gloo|nccl://host:0 take a free port (the listener fills it in); local://NAME
    takes a fresh name (pid and random bits: two groups on one host never collide), so its engine ranks must run
    on this host as this user (local's rendezvous directory is 0700, its peers checked by uid).

    gloo and nccl pairs are groups of two (world_size=2): the trainer rank and the engine rank, in lockstep, the
    pieces as collectives (nccl: through GPU buffers on both ends). Their listener forms a new group each time the
    engine rank dials again (torchdist's generations), so a restarted engine rank rejoins the same address and
    takes a keyframe, as over tcp.

    Only tcp takes the token: ucx, local, gloo and nccl have no token option, so on them the pieces are not
    authenticated in transit (their per-version checksums still are compared with the trainers' over the
    coordinator link, tcp with the token: that catches corruption, not a deliberate forgery, since they are xxh3,
    not a MAC), and a ucx, gloo or nccl Publisher beyond loopback serves anyone who reaches its port first: a
    warning says so."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport == "local":
        return f"local://ws-{os.getpid()}-{secrets.token_hex(4)}-{tag}"
    if transport != "tcp" and tag is None:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            log.warning("%s Publishers on %s are not authenticated (the token guards the coordinator link only): "
                        "anyone who reaches their ports can subscribe and read this rank's pieces", transport, host)
    return f"{transport}://{host}:0" + ("?world_size=2" if transport in GROUPS else "")


class ShardPublisher:
    """Trainer rank `rank` of `plan`: publishes its pieces to the engine ranks that need them.

    coordinator: the coordinator's address; with host_coordinator=True this rank runs it there (port 0: any
    free port, then read ``coordinator_address``). transport: what this rank's Publishers listen on, one per engine
    rank it sends to: "tcp" (the default), "ucx", "local", "gloo" or "nccl" (see ``data_address``); engine ranks dial the addresses
    they are given (the coordinator's address book). The coordinator link is tcp whatever this says. host: where
    tcp and ucx Publishers listen, on free ports; local ones take a fresh name each. timeout: seconds a round
    may wait for every engine rank to be ready; connect_timeout: seconds to reach the coordinator (the constructor
    waits: a version published before would get no round). coordinator_state_dir: with host_coordinator, where
    the coordinator records its decisions (commit.Coordinator's state_dir). quantize: a wsync.quant Quantizer (or
    what wsync.quant.from_config reads) for a plan routed over ``quantized_layout(trainer_layout, q)``: publish()
    still takes this rank's BF16 local tensors and quantizes them here, each into its box of q(full state) (see
    quantized.py); q writes its outputs into buffers it keeps per name, so ranks sharing a process each take a
    Quantizer of their own. publisher_config: wsync.Publisher's (codec, ...).
    """

    def __init__(self, plan, rank: int, *, coordinator: str, host_coordinator: bool = False, token=None,
                 host: str = "127.0.0.1", transport: str = "tcp", timeout: float = 60.0, backend: str | None = None,
                 listen_opts: dict | None = None, link_opts: dict | None = None, connect_timeout: float = 60.0,
                 coordinator_state_dir=None, quantize=None, **publisher_config):
        if not (isinstance(rank, int) and 0 <= rank < plan.trainer.ranks):
            raise ValueError(f"trainer rank must be in [0, {plan.trainer.ranks}), got {rank!r}")
        data_address(transport, host, None)  # a bad transport fails before anything listens
        self.plan, self.rank, self.transport = plan, rank, transport
        self.sends = plan.sends(rank)  # engine rank -> this rank's pieces for it
        self.quantize = None if quantize is None else LocalQuantizer(
            as_quantizer(quantize, backend=backend), plan, rank, {p.src_name for ps in self.sends.values() for p in ps})
        self.kernels = backends.kernels(backend)
        self.coordinator = Coordinator(plan, coordinator, token=token, timeout=timeout, link_opts=link_opts,
                                       state_dir=coordinator_state_dir) if host_coordinator else None
        self.coordinator_address = self.coordinator.address if self.coordinator else coordinator
        self.buffers = {r: buffers_for(plan, pieces) for r, pieces in self.sends.items()}
        self._names = sorted({p.src_name for pieces in self.sends.values() for p in pieces})
        self._bound = {r: bind(bufs) for r, bufs in self.buffers.items()}
        # each destination's pieces as one stream: a buffer per piece, in the order the engine rank hashes them
        self._order = {r: streams.ordered(pieces) for r, pieces in self.sends.items()}
        self._dst = {r: streams.tables((streams.bits_view(self.buffers[r][p.key]), full_box(box_shape(p.src)))
                                       for p in order) for r, order in self._order.items()}
        self._src = {r: streams.Cache() for r in self.sends}
        self._on_device: dict = {}  # (engine rank, device) -> its piece buffers there, for local tensors on a GPU
        self.publishers: dict[int, Publisher] = {}
        self._cv = threading.Condition()
        self.settled: list[dict] = []  # the coordinator's outcomes, oldest first
        try:
            for r in self.sends:
                self.publishers[r] = Publisher(data_address(transport, host, f"t{rank}e{r}"),
                                               token=data_token(transport, token), listen_opts=listen_opts,
                                               backend=backend, **publisher_config)
            self.addresses = {r: pub.address for r, pub in self.publishers.items()}
            join = {"role": "trainer", "rank": rank, "plan": plan.hash, "addresses": digests_doc(self.addresses)}
            self._announced: dict | None = None  # the last "published" said, said again on every join
            self.member = Member(self.coordinator_address, join, self._on_message, token=token, link_opts=link_opts,
                                 on_join=self._announce_again)
            self.member.wait_up(connect_timeout)  # a version published before the link is up would get no round
        except BaseException:
            if hasattr(self, "member"):
                self.member.close()
            self._close_parts()
            raise

    def publish(self, local_tensors: dict, version: int) -> None:
        """Send this rank's pieces of `version` (every trainer rank calls it with the same version).

        local_tensors: parameter name -> this rank's local tensor of it (a DTensor is taken by its local
        tensor); only names this rank sends pieces of are read (with quantize=, the BF16 tensors they are made
        from)."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        import torch

        if self.quantize is not None:
            local_tensors = self.quantize(local_tensors)
        partials, local = {}, trainer_locals(self.plan, self.rank, local_tensors, self._names)
        k = on_one_device(local)
        if k is not None:
            self._publish_device(k, local, version)
            return
        where = tuple((n, t.data_ptr(), tuple(t.stride()), t.dtype) for n, t in local.items())
        for r, order in self._order.items():
            src = self._src[r].get(where, lambda: self._src_tables(local, order))
            if src is not None:  # one multi-tensor copy-and-hash of every piece for this engine rank
                sums = streams.copy_sums(self.kernels, src, self._dst[r])
            else:  # a local tensor that is not a contiguous CPU tensor: a copy per piece, then one hash
                bufs = self.buffers[r]
                with torch.no_grad():  # the trainer's parameters require grad; a copy of them need not
                    for p in order:
                        bufs[p.key].copy_(local[p.src_name][_slices(p.local)])
                sums = streams.sums(self.kernels, self._dst[r])
            partials[r] = partial_digest(sums)
            self.publishers[r].publish(self._bound[r], version)
        self._announce(version, partials)

    def _publish_device(self, k, local: dict, version: int) -> None:
        """publish() for local tensors on one GPU: each engine rank's pieces copied into device buffers of
        their own on the caller's stream, hashed there, and published from there (wsync.device)."""
        rt, first = k.rt, next(iter(local.values()))
        partials = {}
        for r, order in self._order.items():
            bufs = self._device_buffers(k, r, rt.device_of(first))
            with rt.stream_of(first):  # after what the caller queued on its stream (the optimizer step)
                for p in order:
                    rt.copy_box(bufs[p.key], local[p.src_name], p.local)
            partials[r] = partial_digest(streams.device_sums(k, [(bufs[p.key], None) for p in order]))
            self.publishers[r].publish(bufs, version)
        self._announce(version, partials)

    def _device_buffers(self, k, r: int, device: int) -> dict:
        """Engine rank r's piece buffers on `device`, allocated once (the host ones stay for a host state)."""
        key = (r, device)
        if key not in self._on_device:
            rt = k.rt
            self._on_device[key] = {
                p.key: rt.empty_tensor(box_numel(p.src), dtypes.from_torch(self.plan.trainer.params[p.src_name].dtype),
                                       device, box_shape(p.src)) for p in self._order[r]}
        return self._on_device[key]

    def _announce(self, version: int, partials: dict) -> None:
        self._announced = {"version": version, "partials": digests_doc(partials)}
        self.member.send("published", self._announced)

    def _announce_again(self) -> None:
        """A coordinator that restarted (or a link that came back) learns of the newest version from here: one
        published while it was gone still gets its round."""
        if self._announced is not None:
            self.member.send("published", self._announced)

    @staticmethod
    def _src_tables(local: dict, order) -> dict | None:
        views = {n: streams.bits_view(t) for n, t in local.items()}
        if any(v is None for v in views.values()):
            return None
        return streams.tables((views[p.src_name], p.local) for p in order)

    def wait(self, version: int, timeout: float | None = None, complete: bool = False) -> dict:
        """The coordinator's outcome for `version` or the newer version its round was for: a dict with
        version, outcome ("committed" or "aborted"), reason, digest (the engine's), expected (the trainer's),
        complete and unconfirmed. A commit some engine rank has not confirmed yet (its link dropped as the
        decision went out) is complete=False, naming the ranks in unconfirmed; the coordinator says it again
        once they confirm. complete=True waits for that word (an abort is complete as decided)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                hit = next((s for s in self.settled if s["version"] >= version
                            and (s.get("complete", True) or not complete)), None)
                if hit is not None:
                    return hit
                if self.member.refused:
                    raise self.member.error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SettleTimeout(f"no round for version {version} settled within {timeout:g}s "
                                        f"(last settled: {self.settled[-1] if self.settled else None})")
                self._cv.wait(0.5 if left is None else min(left, 0.5))

    @property
    def stats(self) -> ShardPublisherStats:
        """A copy of this rank's counters (see ShardPublisherStats), as Publisher.stats is."""
        piece_bytes = sum(b.numel() * b.element_size() for bufs in self.buffers.values() for b in bufs.values())
        sent: dict[int, int] = {}
        for pub in self.publishers.values():
            for v, n in pub.stats.bytes.items():
                sent[v] = sent.get(v, 0) + (n or 0)
        return ShardPublisherStats(pieces=sum(len(p) for p in self.sends.values()), piece_bytes=piece_bytes,
                                   bytes=sent)

    def close(self) -> None:
        self.member.close()
        self._close_parts()

    def _close_parts(self) -> None:
        for pub in self.publishers.values():
            pub.close()
        if self.coordinator is not None:
            self.coordinator.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _on_message(self, msg) -> None:
        if msg.kind == "settled" and isinstance(msg.meta.get("version"), int):
            doc = dict(msg.meta)
            with self._cv:
                same = [i for i, s in enumerate(self.settled) if s["version"] == doc["version"]]
                if same:  # the coordinator's newer word on a round (a late rank confirmed it): it replaces the old
                    self.settled[same[-1]] = doc
                else:
                    self.settled.append(doc)
                    del self.settled[:-1000]
                self._cv.notify_all()

