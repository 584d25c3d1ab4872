"""An engine rank's staging: its pieces, received and verified apart from the live weights, then copied in.

Each trainer rank that sends this rank pieces runs one wsync Publisher for it;
here one Subscriber follows each, into a host-memory staging engine (a
Shadow: piece key -> the piece's bytes). So the codec per piece, deltas
against the previous version of the same piece, keyframes, catch-up,
checksums and auth are the single-engine protocol's, unchanged.

What is new is *when* a version may apply. The Subscribers run in poll mode:
their receiver threads stage versions as they arrive, and this rank applies
them to its staging only up to the version of the coordinator's round
(``advance``). So between ``ready(v)`` and the coordinator's answer the staging
holds exactly v from every source, and ``commit`` copies exactly v, even if
v+1 is already on the wire.
"""
from __future__ import annotations

import logging
import threading

from .. import backends
from ..shadow import Shadow
from ..device import on_one_device
from ..errors import MismatchError, TransportError
from ..snapshot import to_bits, to_torch
from ..subscriber import Subscriber
from ..transports.base import parse_address
from . import streams
from .layout import box_numel, box_shape
from .rounds import partial_digest

log = logging.getLogger("wsync.shard")


class Source(Subscriber):
    """A Subscriber that applies staged versions only as far as it is told (always in poll mode)."""

    on_staged = None  # called (on the receiver thread) once a whole version is staged: the rank's thread wakes

    def _stage(self, st) -> None:
        super()._stage(st)
        if self.on_staged is not None:
            self.on_staged()

    def _queue(self) -> list:
        """The versions staged, oldest first (a plain list, or the list a Staging keeps)."""
        return getattr(self._staged, "items", self._staged)

    def apply_through(self, version: int) -> str | None:
        """Apply every staged version up to `version`, in order; returns why one failed, or None."""
        failed = None
        with self._apply_lock:
            while True:
                with self._cv:
                    staged = self._queue()
                    if not staged or staged[0].version > version:
                        return failed
                    st = staged.pop(0)
                    before = self._stats.failures
                self._apply(st)
                with self._cv:
                    if self._stats.failures > before:
                        failed = f"version {st.version} failed to stage: {self._apply_error}"

    def overshot(self, version: int) -> bool:
        """The next version staged is past `version` while this source does not hold it: it never will."""
        with self._cv:
            staged = self._queue()
            return self.version != version and bool(staged) and staged[0].version > version

    def restart(self) -> None:
        """Forget what is staged and take a keyframe (the staging was found wrong after it verified)."""
        with self._apply_lock:
            with self._cv:
                self.version = self.engine.version = None
                self._served = self._bound = None
                self._queue().clear()
            self._lost()


class DevicePieces:
    """A source's staging on the GPU: a device buffer per piece, allocated once beside the live tensors; its
    Subscriber applies each version there (wsync.device.DeviceEngine)."""

    def __init__(self, k, pieces, tensors: dict):
        rt, first = k.rt, next(iter(tensors.values()))
        device = rt.device_of(first)
        with rt.stream_of(first):
            self.state = {p.key: rt.empty_tensor(box_numel(p.dst), rt.dtype_of(tensors[p.dst_name]), device,
                                                 box_shape(p.dst)) for p in pieces}
        self.version: int | None = None

    def tensors(self) -> dict:
        return self.state

    def load(self, named) -> None:
        raise MismatchError("device pieces are written on the device, never loaded from the host")


DATA_SCHEMES = ("tcp", "ucx", "local", "gloo", "nccl")  # what a pair's Publisher may listen on (sync.TRANSPORTS)
GROUPS = ("gloo", "nccl")  # pairs as torch.distributed groups of two
GROUP_PARAMS = {"world_size"}  # the only option a pair's group address may carry (the rest: connect_opts here)


def data_scheme(address: str) -> str:
    """The transport of a pair's Publisher address, as the coordinator's book gave it (so: checked here)."""
    try:
        addr = parse_address(address)
    except ValueError as e:
        raise TransportError(f"trainer publisher address {address!r:.80}: {e}") from None
    if addr.scheme not in DATA_SCHEMES:
        raise TransportError(f"trainer publisher address {address!r:.80}: a pair's pieces travel over "
                             f"{', '.join(DATA_SCHEMES)}, not {addr.scheme}")
    if addr.scheme in GROUPS and (set(addr.params) != GROUP_PARAMS or addr.params["world_size"] != "2"):
        # a group's size, chunk and pool sizes would otherwise be the book's to choose
        raise TransportError(f"trainer publisher address {address!r:.80}: a pair's {addr.scheme} group takes "
                             f"world_size=2 and no other option")
    return addr.scheme


def data_token(where: str, token):
    """The token for a pair's link over `where` (a transport name or an address): tcp authenticates with it;
    ucx, local, gloo and nccl take none (their options have no token)."""
    scheme = data_scheme(where) if "://" in where else where
    return token if scheme == "tcp" else None


def _slices(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


class Stage:
    """The staging of one engine rank: a Source per trainer rank, and the copy into the live tensors."""

    def __init__(self, pieces, tensors: dict, addresses: dict[int, str], *, token=None, backend: str | None = None,
                 connect_opts: dict | None = None, progress=None, on_staged=None):
        self.tensors = tensors
        self.by_src: dict[int, list] = {}
        for p in pieces:
            self.by_src.setdefault(p.src_rank, []).append(p)
        missing = sorted(set(self.by_src) - set(addresses))
        if missing:
            raise MismatchError(f"no publisher address for trainer ranks {missing}, which send this rank pieces")
        for s in self.by_src:
            data_scheme(addresses[s])
        self.kernels = backends.kernels(backend)
        self.lock = threading.RLock()  # held while live tensors are written: a forward pass holds it too
        # per source: its pieces in the order the trainer rank hashed them, and Tables of their staged bytes and
        # of their boxes in the live tensors (one multi-tensor call per source and dtype, not one per piece)
        self.order = {s: streams.ordered(pieces) for s, pieces in self.by_src.items()}
        self._staged_tables = {s: streams.Cache() for s in self.by_src}
        self._live_tables = {s: streams.Cache() for s in self.by_src}
        self._live_sums: dict[int, dict[str, str]] = {}  # source -> checksums of what the live tensors hold of it
        # live tensors on one GPU: the pieces are staged there too (a buffer per piece, applied on the device)
        self.device = on_one_device(tensors)
        self.sources: dict[int, Source] = {}
        for s in sorted(self.by_src):
            tell = None if progress is None else (lambda *a, s=s: progress(s, *a))
            engine = Shadow() if self.device is None else DevicePieces(self.device, self.order[s], tensors)
            self.sources[s] = Source(addresses[s], engine=engine, token=data_token(addresses[s], token), apply="poll",
                                     backend=backend, connect_opts=connect_opts, progress=tell)
            self.sources[s].on_staged = on_staged

    def advance(self, version: int) -> tuple[str, str | None]:
        """Apply what has arrived up to `version`: ("ready", None) once every source holds exactly it,
        ("failed", why) if one cannot get there, ("waiting", None) otherwise."""
        for s, src in self.sources.items():
            why = src.apply_through(version)
            if why is not None:
                return "failed", f"from trainer rank {s}: {why}"
            if src.overshot(version):
                return "failed", f"trainer rank {s} sent a version past {version} before it (a keyframe of a newer one)"
        if all(src.version == version for src in self.sources.values()):
            return "ready", None
        return "waiting", None

    def staged_sums(self) -> dict[int, dict[str, str]]:
        """trainer rank -> the checksums of its staged pieces as one stream per dtype (read again, so a staged
        buffer changed after its Subscriber verified it is caught)."""
        if self.device is not None:
            return {s: streams.device_sums(self.device, self._staged_pairs(s)) for s in self.by_src}
        return {s: streams.sums(self.kernels, self._staged(s)) for s in self.by_src}

    def _staged_pairs(self, s: int) -> list:
        held = self.sources[s].engine.tensors()
        return [(held[p.key], None) for p in self.order[s]]

    def _commit_device(self, s: int) -> dict[str, str]:
        """Source s's staged pieces copied into their boxes of the live tensors on the device, and the checksums
        of what those boxes then hold, read back on the device."""
        rt, held = self.device.rt, self.sources[s].engine.tensors()
        first = next(iter(self.tensors.values()))
        with rt.stream_of(first):
            for p in self.order[s]:
                rt.write_box(self.tensors[p.dst_name], p.dst, held[p.key])
        return streams.device_sums(self.device, [(self.tensors[p.dst_name], p.dst) for p in self.order[s]])

    def commit(self, staged: dict[int, dict[str, str]]) -> dict[int, str]:
        """Copy every source's staged pieces whose bytes differ from what the live tensors hold, then return the
        partial digests of what the live tensors hold (read back from them)."""
        live = {}
        with self.lock:
            for s in self.by_src:
                if self._live_sums.get(s) == staged[s]:
                    live[s] = partial_digest(self._live_sums[s])
                    continue
                if self.device is not None:
                    self._live_sums[s] = self._commit_device(s)
                    live[s] = partial_digest(self._live_sums[s])
                    continue
                dst = self._live(s)
                if dst is not None:  # one multi-tensor copy per dtype into the live tensors' boxes
                    streams.copy_sums(self.kernels, self._staged(s), dst)
                else:  # a live tensor that is not a contiguous CPU tensor: a copy per piece
                    state = self.sources[s].engine.state
                    for p in self.order[s]:
                        self.tensors[p.dst_name][_slices(p.dst)].copy_(to_torch(state[p.key]))
                self._live_sums[s] = self._read_live(s, dst)
                live[s] = partial_digest(self._live_sums[s])
        return live

    def _staged(self, s: int) -> dict:
        state = self.sources[s].engine.state
        where = tuple(id(state[p.key].bits) if p.key in state else None for p in self.order[s])
        if None in where:
            raise MismatchError(f"trainer rank {s} staged no piece {self.order[s][where.index(None)].key}")
        return self._staged_tables[s].get(where, lambda: streams.tables(
            (state[p.key].bits.reshape(-1), ((0, state[p.key].bits.size),)) for p in self.order[s]))

    def _live(self, s: int) -> dict | None:
        """Tables of source s's boxes in the live tensors, or None if one is not a contiguous CPU tensor."""
        where = tuple((n, t.data_ptr()) for n, t in self.tensors.items())

        def build():
            views = {n: streams.bits_view(t) for n, t in self.tensors.items()}
            if any(views[p.dst_name] is None for p in self.order[s]):
                return None
            return streams.tables((views[p.dst_name], p.dst) for p in self.order[s])
        return self._live_tables[s].get(where, build)

    def _read_live(self, s: int, tables) -> dict[str, str]:
        if tables is None:  # read each box out (a copy), then hash the copies as one stream
            tables = streams.tables((to_bits(self.tensors[p.dst_name][_slices(p.dst)]).bits,
                                     ((0, box_numel(p.dst)),)) for p in self.order[s])
        return streams.sums(self.kernels, tables)

    def keyframe(self, srcs) -> None:
        """These sources staged something wrong: start them over from a keyframe, and rewrite their pieces."""
        for s in srcs:
            if s in self.sources:
                log.warning("pieces from trainer rank %d staged wrong; asking it for a keyframe", s)
                self.sources[s].restart()
                self._live_sums.pop(s, None)

    def received_bytes(self) -> int:
        return sum(src.stats.bytes for src in self.sources.values())

    def close(self) -> None:
        for src in self.sources.values():
            src.close()
