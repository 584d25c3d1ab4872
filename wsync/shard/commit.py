"""One version on every engine rank or on none: the coordinator of a two-phase commit, and the digests it checks.

Each engine rank stages a version from several trainer ranks; a rank that
committed on its own would serve version v while a peer still serves v-1
(a TP group computing with two models), or a rank that died half way would
leave its peers with no agreed version. So ranks stage and verify, report
*ready*, and copy into their live weights only when the coordinator says
*commit*, which it says only after every engine rank is ready with the digests
the trainer ranks announced. A failure, a lost rank or the round's timeout makes
it say *abort* to all: every rank keeps serving the previous version.

Messages (JSON meta, no blobs), over Member links (member.py)::

    any -> coord     join {role: "trainer"|"engine", rank, plan, addresses (trainers: engine rank -> address)}
    coord -> engine  book {addresses: {trainer rank: address}}   where its sources publish, once all have joined
    trainer -> coord published {version, partials: {engine rank: digest}}
    coord -> engine  prepare {version}                            every trainer rank published it
    engine -> coord  ready {version, partials: {trainer rank: digest}}  |  failed {version, reason}
    coord -> engine  commit {version}  |  abort {version, reason, keyframe: [trainer ranks]}
    engine -> coord  committed {version, partials}                digests of what its live tensors now hold
    coord -> all     settled {version, outcome: "committed"|"aborted", reason, digest}

Rounds run one at a time, for the newest version every trainer rank has
published (versions published meanwhile are skipped: the engines' staging
steps through their deltas anyway). ``abort`` names, per rank, the trainer
ranks whose pieces staged wrong; only those ask for a keyframe (a rank whose
staging verified keeps it, and the next delta applies on top of it).

Digests are defined once, in rounds.py: ``partial`` folds the checksums of
the pieces one trainer rank sends one engine rank, hashed as one stream per
bits dtype in piece-key order (streams.py: one multi-tensor call, not one per
piece), ``rank_digest`` folds a rank's partials by trainer rank,
``engine_digest`` folds the ranks' digests. Trainer and engine ranks
compute partials independently; so neither side needs anyone's whole state.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from ..errors import WsyncError
from ..transports import Message, listen
from ..transports.base import with_token
from .rounds import Round, engine_digest, partial_digest, rank_digest
from .member import LINK_OPTS, Peer, check_digests, check_int, digests_doc

__all__ = ["Coordinator", "SettleTimeout", "engine_digest", "partial_digest", "rank_digest"]
log = logging.getLogger("wsync.shard")


class SettleTimeout(WsyncError, TimeoutError):
    """No round for the version settled in time (the message says the last one that did, where it can)."""


class Coordinator:
    """Runs the rounds of the commit for one plan (hosted by trainer rank 0, or a process of its own).

    timeout: seconds a round may take from prepare to the last engine rank's ready (a rank that never
    answers costs this, then every rank aborts); commit_timeout: seconds to wait for the ranks' committed
    reports once the decision is made (the decision stands; a late rank is only reported).
    """

    def __init__(self, plan, address: str = "tcp://127.0.0.1:0", *, token=None, timeout: float = 60.0,
                 commit_timeout: float = 60.0, link_opts: dict | None = None):
        self.plan, self.timeout, self.commit_timeout = plan, timeout, commit_timeout
        self.M, self.N = plan.trainer.ranks, plan.engine.ranks
        self._sources = {r: sorted({p.src_rank for p in plan.for_engine(r)}) for r in range(self.N)}
        self._listener = listen(address, **with_token({**LINK_OPTS, **(link_opts or {})}, token))
        self.address = self._listener.address
        self._events: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._peers: dict[tuple[str, int], Peer] = {}
        self._book: dict[int, dict[int, str]] = {}  # trainer rank -> engine rank -> publisher address
        self._published: dict[int, dict[int, dict[int, str]]] = {}  # version -> trainer rank -> partials
        self._round: Round | None = None
        self.settled: list[dict] = []  # every round's outcome, oldest first (tests and logs read it)
        self.committed: int | None = None  # the newest version every engine rank committed
        self._closed = False
        self._threads = [threading.Thread(target=self._accept_loop, name="wsync-coord-accept", daemon=True),
                         threading.Thread(target=self._main_loop, name="wsync-coord", daemon=True)]
        for t in self._threads:
            t.start()

    def wait_settled(self, version: int, timeout: float | None = None) -> dict:
        """The outcome of the first round for `version` or newer (a dict as in `settled`)."""
        with self._cv:
            if not self._cv.wait_for(lambda: any(s["version"] >= version for s in self.settled), timeout):
                raise SettleTimeout(f"no round for version {version} settled within {timeout}s")
            return next(s for s in self.settled if s["version"] >= version)

    def close(self) -> None:
        self._closed = True
        self._events.put(None)
        self._listener.close()
        for p in list(self._peers.values()):
            p.close()
        for t in self._threads:
            t.join(timeout=10)

    # -- links ------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                link = self._listener.accept(timeout=0.5)
            except Exception:
                if self._closed:
                    return
                continue
            if link is not None:
                Peer(link, self._events).start()

    # -- the rounds (one thread: every decision is made here, in order) ----------------------------

    def _main_loop(self) -> None:
        while not self._closed:
            try:
                ev = self._events.get(timeout=0.05)
            except queue.Empty:
                ev = ("tick", None, None)
            if ev is None:
                return
            kind, peer, msg = ev
            try:
                if kind == "msg":
                    self._on_message(peer, msg)
                elif kind == "lost":
                    self._on_lost(peer)
                self._tick()
            except Exception as e:  # a malformed message ends that peer, never the coordinator
                log.warning("coordinator: dropping %s: %s", peer.name if peer else "?", e)
                if peer is not None:
                    peer.close()

    def _on_message(self, peer: "Peer", msg: Message) -> None:
        if msg.kind == "join":
            return self._join(peer, msg.meta)
        if peer.role is None:
            raise ValueError(f"{msg.kind!r} before join")
        v = check_int(msg.meta, "version")
        if peer.role == "trainer" and msg.kind == "published":
            self._published.setdefault(v, {})[peer.rank] = check_digests(msg.meta, "partials", self.N)
            while len(self._published) > 64:  # versions some trainer rank never published: never a round
                del self._published[min(self._published)]
            self._start()
        elif peer.role == "engine" and msg.kind in ("ready", "failed", "committed") and self._round is not None:
            self._round_message(peer.rank, msg.kind, v, msg.meta)

    def _join(self, peer: "Peer", meta: dict) -> None:
        role = meta.get("role")
        if role not in ("trainer", "engine"):
            return peer.refuse(f"role must be 'trainer' or 'engine', got {role!r:.20}")
        rank = check_int(meta, "rank", 0, self.M if role == "trainer" else self.N)
        if meta.get("plan") != self.plan.hash:
            return peer.refuse(f"{role} rank {rank} follows plan {meta.get('plan')!r:.20}, the coordinator "
                               f"{self.plan.hash}: both sides must route with the same layouts")
        old = self._peers.get((role, rank))
        if old is not None and old is not peer:
            old.close()
        peer.role, peer.rank = role, rank
        self._peers[(role, rank)] = peer
        if role == "trainer":
            self._book[rank] = check_digests(meta, "addresses", self.N, maxlen=300)
            for r in range(self.N):
                self._send_book(r)
        else:
            self._send_book(rank)
            rnd = self._round
            if rnd is not None and rnd.phase == "prepare" and rank not in rnd.ready:
                peer.send("prepare", {"version": rnd.version})

    def _send_book(self, r: int) -> None:
        peer = self._peers.get(("engine", r))
        if peer is not None and all(s in self._book and r in self._book[s] for s in self._sources[r]):
            peer.send("book", {"addresses": digests_doc({s: self._book[s][r] for s in self._sources[r]})})

    def _on_lost(self, peer: "Peer") -> None:
        if self._peers.get((peer.role, peer.rank)) is peer:
            del self._peers[(peer.role, peer.rank)]
            rnd = self._round
            if peer.role != "engine" or rnd is None:
                return
            if rnd.phase == "prepare":
                self._abort(f"engine rank {peer.rank} lost its link to the coordinator", {})
            else:  # decided: a rank gone now will not report what it holds (it catches up when it is back)
                rnd.lost.add(peer.rank)
                if rnd.all_reported(self.N):
                    self._settle("committed", "")

    def _start(self) -> None:
        """Open a round for the newest version every trainer rank published, if none is running."""
        if self._round is not None:
            return
        last = self.settled[-1]["version"] if self.settled else -1
        full = [v for v, by in self._published.items() if len(by) == self.M and v > last]
        if not full:
            return
        v = max(full)
        expected = {r: {s: self._published[v][s].get(r) for s in self._sources[r]} for r in range(self.N)}
        for old in [u for u in self._published if u <= v]:
            del self._published[old]
        self._round = Round(v, expected, time.monotonic() + self.timeout)
        self._broadcast("engine", "prepare", {"version": v})

    def _round_message(self, rank: int, kind: str, v: int, meta: dict) -> None:
        rnd = self._round
        if v != rnd.version:
            return  # an answer to a round already settled
        if kind == "failed":
            return self._abort(f"engine rank {rank}: {str(meta.get('reason'))[:300]}", {})
        partials = check_digests(meta, "partials", self.M)
        if kind == "ready" and rnd.phase == "prepare":
            rnd.ready[rank] = partials
            if len(rnd.ready) == self.N:
                self._decide()
        elif kind == "committed" and rnd.phase == "commit":
            rnd.committed[rank] = partials
            if rnd.all_reported(self.N):
                self._settle("committed", "")

    def _decide(self) -> None:
        rnd = self._round
        wrong = rnd.wrong(rnd.ready)
        if wrong:
            return self._abort(f"staged pieces digest differently from what the trainer ranks published: "
                               f"{rnd.describe(wrong)}", wrong)
        rnd.phase, rnd.deadline = "commit", time.monotonic() + self.commit_timeout
        self._broadcast("engine", "commit", {"version": rnd.version})

    def _abort(self, reason: str, wrong: dict[int, list[int]]) -> None:
        rnd = self._round
        log.warning("version %d aborted on every engine rank: %s", rnd.version, reason)
        for r in range(self.N):
            peer = self._peers.get(("engine", r))
            if peer is not None:
                peer.send("abort", {"version": rnd.version, "reason": reason, "keyframe": wrong.get(r, [])})
        self._settle("aborted", reason)

    def _settle(self, outcome: str, reason: str) -> None:
        rnd, self._round = self._round, None
        digest = None
        if outcome == "committed":
            wrong = rnd.wrong(rnd.committed)
            if wrong or len(rnd.committed) < self.N:
                reason = (f"after the commit, {rnd.describe(wrong)}; " if wrong else "") + \
                         f"{self.N - len(rnd.committed)} ranks did not report what they hold"
                log.error("version %d committed, but %s", rnd.version, reason)
                for r, srcs in wrong.items():  # those ranks take keyframes; their next commit rewrites every piece
                    peer = self._peers.get(("engine", r))
                    if peer is not None:
                        peer.send("repair", {"version": rnd.version, "keyframe": srcs})
            digest = engine_digest({r: rank_digest(p) for r, p in rnd.committed.items()})
            self.committed = rnd.version
        doc = {"version": rnd.version, "outcome": outcome, "reason": reason, "digest": digest,
               "expected": rnd.engine_digest()}
        with self._cv:
            self.settled.append(doc)
            del self.settled[:-1000]
            self._cv.notify_all()
        self._broadcast("trainer", "settled", doc)
        self._broadcast("engine", "settled", doc)
        self._start()

    def _tick(self) -> None:
        rnd = self._round
        if rnd is None or time.monotonic() < rnd.deadline:
            return
        if rnd.phase == "prepare":
            missing = [r for r in range(self.N) if r not in rnd.ready]
            self._abort(f"timeout: engine ranks {missing} not ready within {self.timeout:g}s", {})
        else:
            self._settle("committed", "")

    def _broadcast(self, role: str, kind: str, meta: dict) -> None:
        for (rl, _), peer in list(self._peers.items()):
            if rl == role:
                peer.send(kind, meta)

