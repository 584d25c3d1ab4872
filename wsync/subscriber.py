"""Subscriber (engine side): follow a Publisher, and move an engine from version to version atomically.

    sub = wsync.Subscriber("tcp://trainer:7070", engine=wsync.engines.HF(model), token=...)
    sub.wait_for(step, timeout=600)   # or, between decode steps: sub.poll()

A receiver thread stages whole versions (every bucket of one version, parsed
and checked); applying them is a transaction (see ``apply_version``): verify
every checksum, write the new weights, verify the digest of what the engine
then holds, and commit the version number. Any failure puts back every element
written, so the engine serves version N or still N-1, never something between;
the subscriber then asks the publisher for a keyframe. A dropped connection is
redialled, and the hello tells the publisher where to resume. Why the last dial
failed is kept in ``error`` and named by wait_for's timeout; a listener that
refuses us (token, protocol version) is dialled less and less often, and after
GIVE_UP refusals in a row wait_for raises the refusal instead of waiting on.

Memory is bounded against the publisher: what the subscriber holds for
versions not yet applied is bounded in bytes by the layout it serves (or, for
an engine with no tensors yet, by ``max_version_bytes``), checked before
anything is allocated (staging.py): a version declaring more buckets or bytes
than one version of that layout can take, with every codec's worst case, is
refused (``staging.Oversized``; the link refuses a larger message at its
header), and wait_for raises it after GIVE_UP refusals in a row. In poll mode
an engine that polls seldom does not make it hold every version meanwhile: one
keyframe and the deltas after it wait (a keyframe supersedes what was staged
before it; deltas past twice the bound are dropped and a keyframe asked for).

``on_commit``, if given, is called once per version the engine commits, in
order, with ``{"version", "bytes", "keyframe", "apply_s"}`` (one poll may commit
several: a keyframe and the deltas after it). A refused version gives no call.
It runs in the applying thread (the receiver's, or poll()'s caller's) after the
commit and the ack; an exception in it is logged and never stops the subscriber.

Threads: the receiver thread stages versions; applying happens there
(apply="background") or in whoever calls poll(), one caller at a time
(_apply_lock). Everything both sides read or write (staged versions, the
version served, counters) is under _cv; stats are an immutable copy.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace

import numpy as np

from . import api, backends
from .bits import TensorBits
from .checksum import state_digest
from .errors import ChecksumError, TransportError, WsyncError
from .exiting import close_at_exit
from .device import DeviceEngine, host_payload, on_one_device
from .layout import Bound, Layout, bind_copying, check_covers, segments
from .payload import Payload
from .sender import PROTOCOL
from .snapshot import as_state, to_torch
from .transports import Message, TransportTimeout, connect
from .tokens import check as check_token
from .transports.base import with_device, with_token
from .transports.tcp.auth import Refused
from .transports.tcp.frames import MessageTooLarge
from .tables import Table
from .staging import NO_LAYOUT_BYTES, Limits, Oversized, Received, Staging, table_bytes

log = logging.getLogger("wsync.sync")
GIVE_UP = 3  # wait_for raises the apply error (or refusal) after this many in a row (the subscriber keeps trying)
MAX_PAUSE = 30.0  # seconds between dials at most, once a listener keeps refusing us
MAX_LAYOUTS = 4096  # member tables kept (a layout per bucket) ...
LAYOUT_BYTES = 64 << 20  # ... and their bytes, unless the version served needs more (see _learn)
WAIT_LOG_S = 5.0  # wait_for without a timeout says what it is waiting for this often: a silent hang helps nobody


@dataclass(frozen=True, kw_only=True)
class Committed:
    """One version the engine committed: its wire bytes, whether it was a keyframe, the seconds its apply took,
    when it committed and the publisher's note on it (what on_commit is handed, as a dict)."""

    version: int
    bytes: int
    keyframe: bool
    apply_s: float
    at: float  # wall clock of the commit: what the engine has served since
    checksum: str | None = None  # the version's digest, which the engine's tensors were checked against
    note: dict | None = None  # the publisher's note on the version (Publisher.publish(note=...))


@dataclass(frozen=True, kw_only=True)
class SubscriberStats:
    """A copy of a subscriber's counters at one moment (Subscriber.stats).

    versions, bytes: versions committed and their wire bytes; failures: versions refused (apply failed, or
    larger than the layout allows); reconnects: dials after the first; last: the newest version committed
    (None before one); staged, staged_bytes: versions received and waiting to be applied, and what they hold.
    """

    versions: int = 0
    bytes: int = 0
    failures: int = 0
    reconnects: int = 0
    last: Committed | None = None
    staged: int = 0
    staged_bytes: int = 0


class WaitTimeout(WsyncError, TimeoutError):
    """wait_for / wait_announced ran out of time; the message says why when the publisher could not be reached."""


class Subscriber:
    def __init__(self, address: str, *, engine, token=None, apply: str = "background", backend: str | None = None,
                 connect_opts: dict | None = None, retry_s: float = 0.5, progress=None, relay: str | None = None,
                 relay_opts: dict | None = None, served: list | None = None, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", on_commit=None, max_version_bytes: int | None = None):
        if apply not in ("background", "poll"):
            raise ValueError(f"apply must be 'background' or 'poll', got {apply!r}")
        if max_version_bytes is not None and (type(max_version_bytes) is not int or max_version_bytes < 1):
            raise ValueError(f"max_version_bytes must be a positive int, got {max_version_bytes!r}")
        self.address, self.engine, self.mode, self.backend = address, engine, apply, backend
        self._token, self._opts, self._retry_s = check_token(token), with_device(address, connect_opts), retry_s
        self.progress = progress  # called as progress(version, bucket, buckets, bytes) as buckets arrive
        self.on_commit = on_commit  # called as on_commit({version, bytes, keyframe, apply_s}) per committed version
        self.newest_seen: int | None = None  # newest version the publisher has announced
        self._lockstep = False  # the link's own (Link.lockstep), once dialled: a group link speaks only in turn
        self._cv = threading.Condition()
        self._apply_lock = threading.RLock()  # one applier at a time: poll() may be called from several threads
        self._staged = Staging()  # versions received, not applied yet: one keyframe and the deltas after it
        # the most one version may take: stated, or from the layout served (or the engine's tensors); see staging.py
        self._max_version_bytes = max_version_bytes
        self._limits: Limits | None = None
        self._limits_of: tuple | None = None  # the hashes of the served layouts _limits was computed from
        self._need_keyframe = False  # an apply failed: ignore deltas until a keyframe comes
        self._streak = 0  # failed applies in a row; keyframe requests back off, and wait_for gives up at GIVE_UP
        self._report_need = False
        self._closed = False
        self._link = None
        self._send_lock = threading.Lock()
        self.version: int | None = engine.version
        self._layouts: dict[str, Layout] = {}  # member tables by hash, learned from keyframes (deltas name them)
        # the layouts of the version the engine serves (given: a replica's, saved with it by `wsync pull`)
        self._served: list[Layout] | None = served if engine.version is not None else None
        self._layout_cost: dict[str, int] = {}  # bytes of each table's JSON, held to a budget (_learn)
        self._layout_bytes = 0
        for m in self._served or []:
            self._learn(m)
        self._bound: Bound | DeviceEngine | None = None  # the engine's tensors, bound once (segment tables reused every version)
        self._bound_key: tuple | None = None  # the memory _bound was made over (memory_key), to see it move
        # the last failure, kept for callers to inspect: an apply refused, or while no link is up, why the last dial failed
        self.error: WsyncError | None = None
        self._apply_error: WsyncError | None = None  # the last apply failure (what wait_for raises at GIVE_UP)
        self._refusals = 0  # dials refused in a row by the listener (not: nothing listening)
        self._said: str | None = None  # the last dial failure logged: a repeat is not logged again
        self._bye = False  # the publisher said goodbye: its absence now is expected, not a failure
        self._stats = SubscriberStats()  # under _cv; staged and staged_bytes are filled in when read
        self.metrics = None
        if metrics_port is not None:
            from .metrics import SubscriberMetrics

            self.metrics = SubscriberMetrics(metrics_port, metrics_host)
        # a relay re-publishes every committed version to its own subscribers (a tree for WAN fan-out)
        self.relay = None
        if relay is not None:
            from .sync import Publisher  # the one direction between the two modules: a relay is a publisher

            self.relay = Publisher(relay, token=token, **(relay_opts or {}))
        self._thread = threading.Thread(target=self._run, name="wsync-subscriber", daemon=True)
        self._thread.start()
        close_at_exit(self)

    # -- engine-facing -----------------------------------------------------------------------

    def poll(self) -> int | None:
        """Apply every staged version now, in this thread; return the newest version applied, or None.

        What waits is at most one keyframe and the deltas after it: a version a later keyframe superseded
        is never applied (and gives no on_commit), since the keyframe alone ends in the same state."""
        applied = None
        with self._apply_lock:  # taken and applied in order, never two versions at once
            while (st := self._take()) is not None:
                if self._apply(st):
                    applied = st.version
        return applied

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until the engine serves `version` or newer; returns the version served.

            sub.wait_for(step, timeout=600)   # WaitTimeout after 600 s, naming why if the publisher is unreachable

        Without a timeout it may wait forever (a publisher that never comes); it then logs what it waits
        for every WAIT_LOG_S seconds, e.g. "waiting for version 3 from tcp://127.0.0.1:7070: nothing
        received yet, 12 s" (a warning while nothing arrives or no link is up). It raises the error after
        GIVE_UP failures in a row: applies refused, oversized versions, or dials refused."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        said = start
        while True:
            if self.mode == "poll":
                self.poll()
            with self._cv:
                if self.version is not None and self.version >= version:
                    return self.version
                if self._streak >= GIVE_UP:
                    raise self._apply_error
                self._check_reachable()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._timeout(f"engine still at version {self.version} after {timeout:g}s, "
                                        f"waited for {version}")
                if deadline is None and time.monotonic() - said >= WAIT_LOG_S:
                    said = time.monotonic()
                    self._say_waiting(version, said - start)
                if not self._staged or self.mode == "background":
                    self._cv.wait(min(left, 0.5) if left is not None else 0.5)

    def _say_waiting(self, version: int, waited: float) -> None:
        """Under _cv: one line on what wait_for waits for (a warning while nothing comes in)."""
        quiet = self.newest_seen is None or self._link is None
        if self.newest_seen is None:
            what = "nothing received yet"
        else:
            what = f"engine at version {self.version}, newest announced {self.newest_seen}"
        if self._link is None:
            what += "; no link to the publisher" + (f": {self.error}" if self.error is not None else "")
        log.log(logging.WARNING if quiet else logging.INFO, "waiting for version %s from %s: %s, %.0f s",
                version, self.address, what, waited)

    def wait_announced(self, timeout: float | None = None) -> int:
        """Block until the publisher has announced a version (its newest on connect); return the newest seen."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.newest_seen is None:
                self._check_reachable()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._timeout(f"{self.address} announced no version within {timeout:g}s")
                self._cv.wait(min(left, 0.5) if left is not None else 0.5)
            return self.newest_seen

    def _check_reachable(self) -> None:
        """Under _cv: raise if closed, or if the listener refused us GIVE_UP times in a row (waiting will not help)."""
        if self._closed:
            raise WsyncError("subscriber is closed")
        if self._refusals >= GIVE_UP:
            raise self.error

    def _timeout(self, what: str) -> WaitTimeout:
        """Under _cv: a timeout that names why the publisher could not be reached, if it could not."""
        if self._link is None and self.error is not None and self.error is not self._apply_error:
            what += f"; no link to the publisher: {self.error}"
        return WaitTimeout(what)

    @property
    def stats(self) -> SubscriberStats:
        """The counters and what waits to be applied, at one moment (see SubscriberStats); safe from any thread."""
        with self._cv:
            return replace(self._stats, staged=len(self._staged.items), staged_bytes=self._staged.held)

    @property
    def note(self) -> dict | None:
        """The publisher's note on the version the engine serves (Publisher.publish(note=...)), or None."""
        with self._cv:
            last = self._stats.last
        return last.note if last is not None else None

    @property
    def served(self) -> list[Layout] | None:
        """The bucket layouts of the version the engine serves (None before the first)."""
        return self._served

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        link = self._link
        if link is not None:
            link.close()
        self._thread.join(timeout=10)
        if self.relay is not None:
            self.relay.close()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- receiving ---------------------------------------------------------------------------

    def _run(self) -> None:
        dialled = False
        while not self._closed:
            if dialled:
                with self._cv:
                    self._stats = replace(self._stats, reconnects=self._stats.reconnects + 1)
                if self.metrics is not None:
                    self.metrics.reconnects.inc()
            dialled = True
            try:
                link = connect(self.address, **with_token(self._opts, self._token))
            except WsyncError as e:
                pause = self._dial_failed(e)
            else:
                pause = self._retry_s
                self._linked(link)
                try:
                    self._narrow(link)
                    # without the layout of what it serves it cannot take deltas: it asks for a keyframe
                    known = self._served is not None
                    self._send(Message("hello", {"protocol": PROTOCOL, "version": self.version if known else None,
                                                 "checksum": self._served_checksum() if known else None}))
                    self._receive(link)
                except WsyncError as e:
                    if isinstance(e, (Oversized, MessageTooLarge)):
                        self._oversized(e)
                    elif not self._closed:
                        self._link_lost(link, e)
                finally:
                    self._link = None
                    link.close()
            with self._cv:  # close() wakes this at once
                self._cv.wait_for(lambda: self._closed, timeout=pause)

    def _linked(self, link) -> None:
        with self._cv:
            self._link, self._refusals, self._said, self._bye = link, 0, None, False
            self._lockstep = link.lockstep
            self.error = self._apply_error  # the dial failure is over
            self._cv.notify_all()

    def _dial_failed(self, e: WsyncError) -> float:
        """Keep why the dial failed, say it once (not on every retry); returns the pause before the next dial.

        A refusal (wrong token, another protocol version) will not cure itself, so the pause doubles, up to
        MAX_PAUSE; nothing listening may be a publisher still starting, so that is dialled every retry_s."""
        refused = isinstance(e, Refused)
        with self._cv:
            self.error = e
            self._refusals = self._refusals + 1 if refused else 0
            self._cv.notify_all()
        if str(e) != self._said:
            self._said = str(e)
            level = logging.ERROR if refused else logging.INFO if self._bye else logging.WARNING
            log.log(level, "cannot reach the publisher %s: %s; %s", self.address, e,
                    "retrying less often" if refused else "retrying")
        return min(self._retry_s * 2 ** (self._refusals - 1), MAX_PAUSE) if refused else self._retry_s

    def _link_lost(self, link, e: WsyncError) -> None:
        # an orderly end (a tcp link's state "closed", not "failed") is the publisher closing, bye or not
        if self._bye or getattr(link, "state", None) == "closed":
            self._bye = True  # so its absence now is not reported as a failure either
            log.info("publisher %s closed the link (%s); waiting for it to come back", self.address, e)
        else:
            log.warning("subscriber link to %s lost (%s); redialling", self.address, e)

    def _version_limits(self) -> Limits:
        """What one version may take (staging.Limits): stated, else from the layouts served, else from the
        engine's tensors, else the cap for a subscriber that knows no layout yet. Cached per layout served."""
        if self._max_version_bytes is not None:
            return Limits.stated(self._max_version_bytes, "max_version_bytes allows")
        served = self._served
        key = None if not served else tuple(m.hash for m in served)  # a new list every version, the same layouts
        if self._limits is None or self._limits_of != key:
            self._limits, self._limits_of = self._limits_from(served), key
        return self._limits

    def _limits_from(self, served) -> Limits:
        if served:
            return Limits.of_layouts(served)
        try:
            with self._apply_lock:  # not while poll() swaps the engine's tensors
                lim = Limits.of_tensors(self.engine.tensors())
        except Exception as e:  # noqa: BLE001 - an engine not ready to list its tensors: the stated cap holds
            log.warning("cannot size versions from the engine's tensors (%s); until a version commits, a version "
                        "may take up to %d bytes (max_version_bytes sets it)", e, NO_LAYOUT_BYTES)
            lim = None
        return lim or Limits.stated(NO_LAYOUT_BYTES, "a subscriber takes while it knows no layout "
                                                     "(set max_version_bytes)")

    def _narrow(self, link) -> None:
        """Tell the link the largest message to accept: a bucket is never more than its version."""
        limit = getattr(link, "limit", None)
        if limit is not None:
            lim = self._version_limits()
            limit(lim.version_bytes, why=lim.why)

    def _oversized(self, e: WsyncError) -> None:
        """A version larger than the layout allows was refused (nothing was allocated for it); counted
        like a refused apply, so wait_for raises it once it keeps happening."""
        with self._cv:
            self.error = self._apply_error = e
            self._streak += 1
            self._stats = replace(self._stats, failures=self._stats.failures + 1)
            self._cv.notify_all()
        log.error("refused a version from the publisher %s: %s; redialling", self.address, e)

    def _served_checksum(self) -> str | None:
        if self.version is None or self._served is None:
            return None
        with self._apply_lock, getattr(self.engine, "lock", None) or nullcontext():  # not while a version applies
            return version_digest(self._bound if self._bound is not None else self.engine.tensors(), self._served,
                                  self.backend)

    def _receive(self, link) -> None:
        cur: Received | None = None
        while not self._closed:
            try:
                msg = link.recv(timeout=1.0)
            except TransportTimeout:
                continue
            if msg.kind == "bye":
                log.info("publisher %s closed; waiting for it to come back", self.address)
                self._bye = True
                return
            if msg.kind == "welcome":
                self._saw(msg.meta.get("newest"))
                continue
            if msg.kind != "bucket" or len(msg.blobs) != 2:
                raise TransportError(f"unexpected {msg.kind!r} message from the publisher")
            if msg.meta.get("index") == 0:  # a new version: the layout served may have changed since the last
                self._narrow(link)
            cur = self._add_bucket(cur, msg)
            if cur is not None and len(cur.payloads) == cur.count:
                self._stage(cur)
                cur = None

    def _add_bucket(self, cur: Received | None, msg: Message) -> Received | None:
        m = msg.meta
        try:
            if m["index"] == 0:
                cur = Received(m, self._version_limits())  # Oversized for more buckets than the layout can have
            elif cur is None or m["version"] != cur.version or m["index"] != len(cur.payloads):
                raise TransportError(f"bucket {m['index']} of version {m['version']} arrived out of order")
            cur.add(msg.nbytes)  # Oversized once the version's buckets add up to more than it can take
            # checked and unzipped now, while later buckets are still on the wire
            payload = Payload.from_parts(msg.blobs[0], msg.blobs[1])
            cur.kept(api.prepare(payload, backend=self.backend))
            self._learn(payload.manifest.members)
            if len(cur.payloads) == cur.count:
                cur.checksum = m["checksum"]
                if not isinstance(cur.checksum, str):
                    raise TransportError(f"version {cur.version} arrived without its digest")
            self._saw(cur.version)
            if self.progress is not None:
                self.progress(cur.version, m["index"] + 1, cur.count, cur.nbytes)
        except (KeyError, TypeError) as e:
            raise TransportError(f"malformed bucket message: {e}") from None
        return cur

    def _stage(self, st: Received) -> None:
        with self._cv:
            kept = self._staged.add(st, 2 * st.limits.version_bytes)
            self._cv.notify_all()
        if not kept:
            log.warning("the engine has not polled while deltas up to version %s arrived: dropped those past the "
                        "first waiting version (more than twice the %s bytes %s); asking for a keyframe",
                        st.version, st.limits.version_bytes, st.limits.why)
            self._ask_keyframe()
        if self.mode == "background":
            self.poll()
        if self._lockstep or self.mode == "poll":
            # point-to-point background subscribers ack after applying (in _apply); the others ack on receipt
            self._ack(st.version)

    def _learn(self, members: Layout | None) -> None:
        """Keep an inline member table, so later deltas can name it by hash.

        Held to MAX_LAYOUTS tables and, in bytes of their JSON, to LAYOUT_BYTES or three times those of
        the version served, whichever is more: a publisher could otherwise send a new large table with
        every version. The oldest go first, never those of the version served (its deltas need them)."""
        if members is None or members.hash in self._layouts:
            return
        cost = table_bytes(members.names, [len(s) for s in members.shapes])
        with self._cv:
            keep = {m.hash for m in self._served or []}
            budget = max(LAYOUT_BYTES, 3 * sum(self._layout_cost.get(h, 0) for h in keep))
            for h in list(self._layouts):
                if len(self._layouts) < MAX_LAYOUTS and self._layout_bytes + cost <= budget:
                    break
                if h not in keep:
                    del self._layouts[h]
                    self._layout_bytes -= self._layout_cost.pop(h, 0)
            self._layouts[members.hash] = members
            self._layout_cost[members.hash] = cost
            self._layout_bytes += cost

    def _saw(self, version) -> None:
        if isinstance(version, int):
            with self._cv:
                self.newest_seen = max(self.newest_seen if self.newest_seen is not None else -1, version)
                newest, served = self.newest_seen, self.version
                self._cv.notify_all()
            if self.metrics is not None:
                self.metrics.behind(newest, served)

    def _take(self) -> Received | None:
        with self._cv:
            return self._staged.take()

    def _send(self, msg: Message) -> None:
        link = self._link
        if link is None:
            return
        with self._send_lock:
            try:
                link.send(msg)
            except WsyncError as e:
                if not self._closed:  # a close() that lands mid-send stops it: not worth a warning
                    log.warning("could not tell the publisher %s: %s", msg.kind, e)

    def _lost(self) -> None:
        """Ignore deltas until a keyframe arrives, and ask for one (after a pause if keyframes keep failing)."""
        self._need_keyframe = True
        if self._streak > 1:  # a keyframe that cannot apply here would otherwise be re-sent in a hot loop
            time.sleep(min(0.1 * 2 ** self._streak, 10.0))
        self._ask_keyframe()

    def _ask_keyframe(self) -> None:
        if self._lockstep:
            with self._cv:
                self._report_need = True  # said in the next ack: a group link only speaks in lockstep
        else:
            self._send(Message("need", {"served": self.version}))

    def _ack(self, version: int) -> None:
        with self._cv:  # the receiver thread acks too (lockstep, poll mode)
            need, self._report_need = self._report_need, False  # a failure is reported once, not on every ack
            served = self.version
        self._send(Message("ack", {"version": version, "served": served, "need_keyframe": need}))

    # -- applying ----------------------------------------------------------------------------

    def _moved(self) -> bool:
        """Whether the engine's tensors are other memory than the Bound in use was made over."""
        return self._bound_key is not None and memory_key(self.engine.tensors()) != self._bound_key

    def _apply(self, st: Received) -> bool:
        if self.version is not None and st.version <= self.version:
            return False  # already have it (a catch-up chain may overlap what we hold)
        if not st.keyframe and self._need_keyframe:
            return False  # a keyframe is on its way
        if not st.keyframe and st.base_version != self.version:
            log.warning("version %s needs base %s but the engine serves %s; asking for a keyframe",
                        st.version, st.base_version, self.version)
            self._lost()
            return False
        t0 = time.perf_counter()
        with self._cv:
            layouts = dict(self._layouts)  # the receiver thread learns new ones meanwhile
        try:
            with getattr(self.engine, "lock", None) or nullcontext():  # guarded engines: not mid-forward
                if st.keyframe or (self._bound is not None and self._moved()):
                    self._bound = None  # bound again: the engine's tensors may be other memory now
                if self._bound is None and not (st.keyframe and hasattr(self.engine, "replace")):
                    live = self.engine.tensors()
                    self._bound = bind_engine(self.engine, live)  # an engine that replaces takes keyframes whole
                    self._bound_key = memory_key(live)
                served = apply_version(self.engine, st.payloads, st.checksum, backend=self.backend,
                                       layouts=layouts, bound=self._bound)
        except WsyncError as e:
            self._bound = None  # bound again on the next try, in case the engine's tensors moved
            with self._cv:
                self.error = self._apply_error = e
                self._streak += 1
                self._stats = replace(self._stats, failures=self._stats.failures + 1)
            if self.metrics is not None:
                self.metrics.failed(e)
            log.error("version %s refused, engine stays at %s: %s", st.version, self.version, e)
            self._lost()
            return False
        apply_s = time.perf_counter() - t0
        with self._cv:
            self._served = served
            self.engine.version = self.version = st.version
            self._need_keyframe = False
            self._streak = 0
            committed = Committed(version=st.version, bytes=st.nbytes, keyframe=st.keyframe, apply_s=apply_s,
                                  at=time.time(), note=st.note, checksum=st.checksum)
            self._stats = replace(self._stats, versions=self._stats.versions + 1,
                                  bytes=self._stats.bytes + st.nbytes, last=committed)
            newest = self.newest_seen
            self._cv.notify_all()
        if self.metrics is not None:
            latency = None if st.published_at is None else time.time() - st.published_at
            self.metrics.committed(st.version, "raw" if st.keyframe else "delta", st.nbytes, apply_s, latency)
            self.metrics.served(st.version, st.note, committed.at)
            self.metrics.behind(newest, st.version)
        if self.mode == "background" and not self._lockstep:
            self._ack(st.version)
        if self.relay is not None:
            self.relay.publish(self._bound if isinstance(self._bound, Bound) else self.engine.tensors(),
                               version=st.version, note=st.note)
        if self.on_commit is not None:
            try:
                self.on_commit(asdict(committed))
            except Exception:  # noqa: BLE001 - the caller's hook; the version is committed whatever it does
                log.exception("on_commit raised for version %s (ignored)", st.version)
        return True


def apply_version(engine, payloads: list[Payload], checksum: str, *, backend: str | None = None,
                  layouts: dict | None = None, bound: Bound | None = None) -> list[Layout]:
    """Apply one version's payloads to an engine as a transaction (all or nothing).

    Every payload checksum and base checksum is verified before anything is
    written; then the new values are written into the engine's Bound: in
    place where it views the engine's memory, and into its own copies
    elsewhere (device tensors, strided or guarded ones), whose changed
    tensors are then handed to engine.load; then the digest of what the
    engine holds must equal `checksum`. On any failure every written element
    is put back, in the engine and in the copies, which therefore always hold
    the version the engine serves: the base of the next delta.
    layouts: member tables by hash, for payloads that name theirs (deltas);
    bound: the engine's tensors bound once (bind_engine), reused every version.
    Returns the version's bucket layouts.
    """
    members = [api.resolve(p.manifest, layouts) for p in payloads]
    whole = hasattr(engine, "replace") and all(p.manifest.codec == "raw" for p in payloads)
    state = None if whole else bound if bound is not None else bind_engine(engine)
    if isinstance(state, DeviceEngine):
        state.apply(payloads, checksum, members)
        return members
    # from here on the host does the work: a body a link left in device memory comes over once
    payloads = [host_payload(p, backends.transfers()) if p.on_device else p for p in payloads]
    if whole:
        _replace(engine, payloads, checksum, backend)
        return members
    _check_covers(state, members)
    # verifies every base and payload checksum, writes, and checks every result against the manifest
    applied: list = []
    undo, records = api.apply_payloads_inplace(state, payloads, backend=backend, layouts=layouts, log=applied)
    changed = []
    try:
        if state.sources:
            changed = [n for n in changed_tensors(payloads, members, applied) if n in state.sources]
            if changed:
                engine.load({name: to_torch(state[name]) for name in changed})
            held = version_digest(engine.tensors(), members, backend)
        else:  # every segment was just checked against the manifest, in the engine's own memory
            held = state_digest(records)
        if held != checksum:
            raise ChecksumError(f"after loading, the engine's weights digest to {held}, expected {checksum}")
    except BaseException:
        undo()
        if changed:
            engine.load({name: to_torch(state[name]) for name in changed})
        raise
    return members


def changed_tensors(payloads: list[Payload], members: list[Layout], applied: list) -> list[str]:
    """The tensors a version wrote at least one element of, from each segment's Applied (in order).

    A segment spans many tensors; handing an engine only those that changed
    keeps a load (a host-to-device copy, for vLLM) to what the version moved."""
    out, it = [], iter(applied)
    for p, m in zip(payloads, members):
        for j, spec in enumerate(p.manifest.tensors):
            a = next(it)
            if spec.kind == "same":
                continue
            names = m.segment_names(j)
            pos = a.overwritten.positions if a.overwritten is not None else None
            if pos is None or len(names) == 1:
                out += names
                continue
            b = m.bounds
            ends = np.cumsum(m.numels[b[j] : b[j + 1]])
            out += [names[i] for i in np.unique(np.searchsorted(ends, pos, "right")).tolist()]
    return out


def bind_engine(engine, live=None) -> Bound:
    """The engine's tensors as a Bound (its segment tables are then built once per layout): views of the
    engine's memory where they can be, copies of our own elsewhere (see layout.bind_copying); or, when they
    are all on one GPU and its kernels load, a DeviceEngine that applies versions there.
    live: engine.tensors(), if the caller has it already."""
    live = engine.tensors() if live is None else live
    if isinstance(live, Bound):
        return live
    k = on_one_device(live)
    if k is not None:  # applied on the GPU, in the engine's own memory
        return DeviceEngine(live, k, backends.transfers())
    return bind_copying(live)


def memory_key(tensors) -> tuple | None:
    """The names, addresses and sizes of an engine's tensors: another key means other memory (a model moved,
    reloaded with assign=True, or rebuilt by its framework), where a Bound of the old one would write unseen.
    None for a Bound, which its engine keeps itself."""
    if isinstance(tensors, Bound):
        return None
    return tuple((n, *_address(t)) for n, t in tensors.items())


def _address(t) -> tuple:
    if isinstance(t, TensorBits):
        t = t.bits
    if isinstance(t, Table):  # a tensor presented in pieces (experts fused on one side only)
        return t.addrs.tobytes(), t.size
    if isinstance(t, np.ndarray):
        return t.__array_interface__["data"][0], t.size
    return t.data_ptr(), t.numel()


def _check_covers(state: Bound, members: list[Layout]) -> None:
    """The version's layouts name exactly the engine's tensors (checked once per layout and state)."""
    def check():
        check_covers(state, [n for m in members for n in m.names], "version does not cover the engine's tensors",
                     mine="engine")
        return True
    state.cached(("covers",) + tuple(m.hash for m in members), check)


def version_digest(tensors, members: list[Layout], backend: str | None = None) -> str:
    """The digest a version's payloads promise (checksum.state_digest of its segments), computed from a state
    cut into the version's layouts."""
    k = backends.kernels(backend)
    state = tensors if isinstance(tensors, Bound) else as_state(tensors)
    records = []
    for m in members:
        for key, seg in zip(m.keys(), segments(state, m)):
            records.append((key, seg.dtype.name, (seg.numel,), k.checksum(seg.bits)))
    return state_digest(records)


def _replace(engine, payloads: list[Payload], checksum: str, backend) -> None:
    """A keyframe into an engine that takes states whole. Each bucket is checked against its manifest as it is
    decoded; an engine with replace_parts (engines.Spool) takes them one at a time, so the decoded model is
    never in memory beside the received one."""
    records = [(s.name, s.dtype, (s.numel,), s.checksum) for p in payloads for s in p.manifest.tensors]
    if state_digest(records) != checksum:
        raise ChecksumError(f"keyframe digests to {state_digest(records)}, expected {checksum}")
    parts = (api.apply_state(None, p, backend=backend) for p in payloads)
    if hasattr(engine, "replace_parts"):
        engine.replace_parts(parts)
        return
    new = {}
    for part in parts:
        new.update(part)
    engine.replace(new)
