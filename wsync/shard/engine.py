"""Engine rank side: stage pieces from every trainer rank that sends them, commit only when every rank can.

    sub = ShardSubscriber(plan, rank, {name: p for name, p in tp_model.named_parameters()},
                          coordinator="tcp://trainer0:7071", token=...)
    sub.wait_for(step)          # this rank serves step: and so does every other engine rank
    with sub.lock: model(...)   # a forward pass never sees a commit half copied

One thread per rank does everything in order: it takes the coordinator's
messages, advances the staging as far as the round's version (stage.py),
reports ready or failed, and on commit copies the staged pieces into the live
tensors. Because the same thread does both, the staging cannot move between
the ready it reported and the commit it was answered with.

The tensors are the rank's own local tensors (a DTensor is written through its
local tensor, in place): the model keeps them, so nothing is re-bound.

A rank that voted ready for version v and has heard neither commit nor abort
*holds v pending*: it keeps serving what it served, and asks the coordinator
for v's outcome each time its link comes up and every ``ask_every`` seconds
until it gets one (a commit or abort re-sent, or ``settled``). So a link that
drops just as the decision goes out costs the rank a delay, never a version
apart from its peers. On every join it also says again what it last
committed, since that report may have been lost with the link; it is how the
coordinator learns the rank serves v.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from ..errors import WsyncError, peer_text
from ..exiting import close_at_exit
from ..subscriber import WAIT_LOG_S
from .member import Member, check_digests, check_int, digests_doc
from .rounds import partial_digest
from .stage import Stage
from .tensors import engine_locals

log = logging.getLogger("wsync.shard")


_WAKE = object()  # in the rank's inbox: look at the staging again
_JOINED = object()  # in the rank's inbox: the coordinator link came up (again)


class CommitTimeout(WsyncError, TimeoutError):
    """wait_for ran out of time; the message says what this rank serves and the last outcomes it saw."""


class ShardSubscriber:
    """Engine rank `rank` of `plan`, writing committed versions into `tensors` (engine name -> local tensor).

    coordinator: its address. addresses: trainer rank -> its Publisher's address for this rank (None: the
    coordinator's address book, which the trainer ranks fill when they join). progress: called as
    progress(trainer_rank, version, bucket, buckets, bytes) as buckets arrive (on a receiver thread).
    ask_every: seconds between asks for the outcome of a version this rank voted ready for and heard nothing
    about (it also asks at once each time its coordinator link comes up).
    """

    def __init__(self, plan, rank: int, tensors: dict, *, coordinator: str, addresses: dict | None = None,
                 token=None, backend: str | None = None, connect_opts: dict | None = None,
                 link_opts: dict | None = None, progress=None, ask_every: float = 2.0):
        if not (isinstance(rank, int) and 0 <= rank < plan.engine.ranks):
            raise ValueError(f"engine rank must be in [0, {plan.engine.ranks}), got {rank!r}")
        self.plan, self.rank = plan, rank
        self.tensors = engine_locals(plan, rank, tensors)
        self.pieces = plan.for_engine(rank)
        self._stage_args = dict(token=token, backend=backend, connect_opts=connect_opts, progress=progress,
                                on_staged=lambda: self._inbox.put(_WAKE))
        self.stage: Stage | None = None
        self.lock = threading.RLock()  # the stage copies under it; hold it around a forward pass
        self.version: int | None = None  # the version every engine rank committed, which this one serves
        self.events: list[tuple] = []  # ("committed", v) / ("aborted", v, reason), oldest first
        self.error: WsyncError | None = None
        self._cv = threading.Condition()
        self._inbox: queue.Queue = queue.Queue()
        self._round: int | None = None  # the version of the coordinator's round in progress
        self._reported = False  # this rank answered the round (ready or failed)
        self._staged: dict | None = None  # piece checksums of the staging it reported ready with
        self._report: dict | None = None  # its last committed report, said again on every join
        self.ask_every, self._asked, self._unknown = ask_every, 0.0, None
        self._closed = False
        if addresses is not None:
            self._make_stage({int(s): a for s, a in addresses.items()})
        self.member = Member(coordinator, {"role": "engine", "rank": rank, "plan": plan.hash}, self._inbox.put,
                             token=token, link_opts=link_opts, on_join=lambda: self._inbox.put(_JOINED))
        self._thread = threading.Thread(target=self._run, name=f"wsync-shard-engine{rank}", daemon=True)
        self._thread.start()
        close_at_exit(self)

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until this rank serves `version` or newer (so every rank committed it); returns the version.

        Without a timeout it may wait forever (a trainer that never publishes it), so it logs what it waits
        for every WAIT_LOG_S seconds; pass timeout= (e.g. 600) to get a CommitTimeout naming the last outcomes."""
        start = said = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with self._cv:
            while self.version is None or self.version < version:
                if deadline is None and time.monotonic() - said >= WAIT_LOG_S:
                    said = time.monotonic()
                    log.warning("engine rank %d waiting for version %d (serving %s%s; last outcomes: %s), %.0f s",
                                self.rank, version, self.version,
                                f", version {self.pending} staged" if self.pending is not None else "",
                                self.events[-3:] or "none yet", said - start)
                if self.member.refused:
                    raise self.member.error
                if self._closed:
                    raise WsyncError(f"engine rank {self.rank} was closed while waiting for version {version}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommitTimeout(f"engine rank {self.rank} still serves version {self.version} after "
                                        f"{timeout:g}s, waited for {version}; last outcomes: {self.events[-3:]}"
                                        + (f"; {self.error}" if self.error else ""))
                self._cv.wait(0.5 if left is None else min(left, 0.5))
            return self.version

    def wait_outcome(self, seen: int, timeout: float) -> int:
        """Block until more than `seen` round outcomes have been recorded (``events``, oldest first), or for
        `timeout` seconds; returns how many there are now."""
        with self._cv:
            self._cv.wait_for(lambda: len(self.events) > seen or self._closed, timeout)
            return len(self.events)

    @property
    def pending(self) -> int | None:
        """The version this rank voted ready for and has no outcome of yet (it serves `version` meanwhile)."""
        return self._round if self._round is not None and self._staged is not None else None

    def received_bytes(self) -> int:
        """Payload bytes this rank's staging took from every trainer rank so far."""
        return self.stage.received_bytes() if self.stage is not None else 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        self._thread.join(timeout=10)
        self.member.close()
        if self.stage is not None:
            self.stage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the rank's one thread --------------------------------------------------------------------

    def _make_stage(self, addresses: dict[int, str]) -> None:
        self.stage = Stage(self.pieces, self.tensors, addresses, **self._stage_args)
        self.stage.lock = self.lock

    def _run(self) -> None:
        while not self._closed:
            try:
                msg = self._inbox.get(timeout=0.05)  # a staged version or a message wakes it at once
            except queue.Empty:
                msg = _WAKE
            if msg is None:
                return
            try:
                if msg is _JOINED:
                    self._rejoined()
                elif msg is not _WAKE:
                    self._handle(msg)
                self._advance()
                if self.pending is not None and time.monotonic() - self._asked >= self.ask_every:
                    self._ask()
            except WsyncError as e:  # a bad message or a failed copy: said, and the round fails
                self.error = e
                log.error("engine rank %d: %s", self.rank, e)
                if self._round is not None and not self._reported:
                    self._answer("failed", {"reason": str(e)})

    def _handle(self, msg) -> None:
        meta = msg.meta
        if msg.kind == "book":
            if self.stage is None:
                self._make_stage(check_digests(meta, "addresses", self.plan.trainer.ranks, maxlen=300))
            return
        v = check_int(meta, "version")
        if msg.kind == "prepare":
            self._round, self._reported, self._staged = v, False, None
        elif msg.kind == "commit":
            self._commit(v)
        elif msg.kind == "abort":
            self._abort(v, meta)
        elif msg.kind == "settled":  # the outcome again, for everyone: it settles a rank that missed its decision
            if meta.get("outcome") == "committed" and self.pending == v:
                self._commit(v)
            elif meta.get("outcome") == "aborted" and self._round == v:
                self._abort(v, {"reason": meta.get("reason")})
        elif msg.kind == "repair":
            self._keyframe(meta)
        elif msg.kind == "unknown" and self.pending == v and self._unknown != v:
            self._unknown = v
            log.warning("engine rank %d voted ready for version %d and the coordinator has no record of its "
                        "outcome; it serves version %s meanwhile and keeps asking", self.rank, v, self.version)

    def _commit(self, v: int) -> None:
        """The coordinator decided commit for v: copy the staging in if this rank holds v pending; if it already
        serves v or newer, say so again (its report may have been lost); otherwise (it holds nothing of v) wait
        for a newer version."""
        if self._round == v and self._staged is not None:
            import torch

            with self.lock, torch.no_grad():  # under the lock, a reader sees the version with its bytes
                live = self.stage.commit(self._staged)
                with self._cv:
                    self.version = v
                    self._event("committed", v)
            self._report = {"version": v, "partials": digests_doc(live)}
            self._round, self._staged = None, None
            self.member.send("committed", self._report)
        elif self.version is not None and self.version >= v and self._report is not None:
            self.member.send("committed", self._report)

    def _abort(self, v: int, meta: dict) -> None:
        if self._round == v:
            self._round, self._staged = None, None
        self._keyframe(meta)
        with self._cv:
            if not any(e[0] == "aborted" and e[1] == v for e in self.events[-10:]):
                self._event("aborted", v, peer_text(meta.get("reason")))

    def _rejoined(self) -> None:
        """The link came up: say again what this rank serves, and ask about a version it holds pending."""
        if self._report is not None:
            self.member.send("committed", self._report)
        if self.pending is not None:
            self._ask()

    def _ask(self) -> None:
        self._asked = time.monotonic()
        if self.member.up:  # with the link down, its next join asks
            self.member.send("ask", {"version": self._round})

    def _keyframe(self, meta) -> None:
        srcs = meta.get("keyframe")
        if isinstance(srcs, list) and self.stage is not None:
            self.stage.keyframe([s for s in srcs if type(s) is int])

    def _advance(self) -> None:
        if self._round is None or self._reported or self.stage is None:
            return
        state, why = self.stage.advance(self._round)
        if state == "ready":
            self._staged = self.stage.staged_sums()
            self._answer("ready", {"partials": digests_doc({s: partial_digest(x) for s, x in self._staged.items()})})
        elif state == "failed":
            self._answer("failed", {"reason": why})

    def _answer(self, kind: str, meta: dict) -> None:
        self._reported = True
        self.member.send(kind, {"version": self._round, **meta})

    def _event(self, *ev) -> None:
        """Under _cv."""
        self.events.append(ev)
        del self.events[:-1000]
        self._cv.notify_all()

