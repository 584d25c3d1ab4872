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

    any -> coord     join {role: "trainer"|"engine", rank, plan, incarnation, addresses (trainers: engine -> address)}
    coord -> any     refused {reason}  |  busy {reason}          busy: the rank's slot is held by a live link
    coord -> engine  book {addresses: {trainer rank: address}}   where its sources publish, once all have joined
    trainer -> coord published {version, partials: {engine rank: digest}}
    coord -> engine  prepare {version}                            every trainer rank published it
    engine -> coord  ready {version, partials: {trainer rank: digest}}  |  failed {version, reason}
    coord -> engine  commit {version}  |  abort {version, reason, keyframe: [trainer ranks]}
    engine -> coord  committed {version, partials}                digests of what its live tensors now hold
    coord -> all     settled {version, outcome: "committed"|"aborted", reason, digest, expected, complete, unconfirmed}
    engine -> coord  ask {version}                                it voted ready for version and heard no outcome
    coord -> engine  commit | abort (again)  |  unknown {version}  the decision, or: none recorded here

The decision outlives the link it went out on. A rank's link may drop just
as *commit* goes out; then that rank holds v staged and voted, and serves
v-1. So the coordinator keeps each decision (in memory, and on disk first if
it has a state dir: decisions.py) and says it again: to a rank that rejoins
without having confirmed it, to a rank that asks (a rank holding a voted
version asks on every join and every ``ask_every`` seconds), and in
``settled``, which every rank acts on. A commit is *complete* once every
engine rank confirmed it serves v or newer (its committed report, said again
on every join); until then ``settled`` says complete False and names the
ranks in ``unconfirmed`` (and says so again, complete, when they confirm),
and ``status()`` lists them.

While the coordinator is down, every rank keeps serving its last committed
version, and a rank that holds a voted version keeps it and asks each time
its link comes up. Started again on the same state dir, the coordinator
answers from its decision log (and runs no round for a version already
decided); with no state dir it learns a commit from a rank that reports
serving it (only a coordinator's commit puts a version there), tells the
ranks holding it staged to commit, and commits rather than aborts a round
run again for it. With neither (no log, and every rank that committed v
gone), a rank asking about v is told ``unknown``: it keeps serving v-1 and
says so, and the next round brings every rank to one version.

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

from ..errors import WsyncError, peer_text
from ..transports import Message, listen
from ..transports.base import with_token
from .decisions import DecisionLog
from .rounds import Round, engine_digest, partial_digest, rank_digest
from .member import LINK_OPTS, Peer, check_digests, check_int, digests_doc

__all__ = ["Coordinator", "SettleTimeout", "engine_digest", "partial_digest", "rank_digest"]
log = logging.getLogger("wsync.shard")

KEEP_ROUNDS = 64  # decided rounds kept in memory: a rank only ever asks about the newest one it voted in


class SettleTimeout(WsyncError, TimeoutError):
    """No round for the version settled in time (the message says the last one that did, where it can)."""


class Coordinator:
    """Runs the rounds of the commit for one plan (hosted by trainer rank 0, or a process of its own).

    timeout: seconds a round may take from prepare to the last engine rank's ready (a rank that never
    answers costs this, then every rank aborts); commit_timeout: seconds to wait for the ranks' committed
    reports once the decision is made (the decision stands; a late rank is only reported). state_dir: where
    each decision is recorded before any rank hears it (decisions.py), so a coordinator started again on the
    same dir still tells every rank that asks what was decided; None keeps decisions in memory only.

    Guarantees: once round v is decided, every engine rank that voted in it learns the outcome, however often
    its link drops: the decision is re-sent to a rank that rejoins without having confirmed it and to a rank
    that asks (an engine rank holding a version it voted ready for asks on every join and every few seconds),
    and a commit stays *incomplete* (``complete`` False, ``unconfirmed`` naming the ranks, in ``settled``,
    in ``status()``, in the log and in what the trainer ranks receive) until every engine rank confirms it
    serves v or a newer version. A rank slot held by a live link is never handed to a second join: only the
    same member (its incarnation) may take it over; anyone else is told to wait (``busy``).
    """

    def __init__(self, plan, address: str = "tcp://127.0.0.1:0", *, token=None, timeout: float = 60.0,
                 commit_timeout: float = 60.0, link_opts: dict | None = None, state_dir=None):
        self.plan, self.timeout, self.commit_timeout = plan, timeout, commit_timeout
        self.M, self.N = plan.trainer.ranks, plan.engine.ranks
        self._sources = {r: sorted({p.src_rank for p in plan.for_engine(r)}) for r in range(self.N)}
        self._events: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._peers: dict[tuple[str, int], Peer] = {}
        self._book: dict[int, dict[int, str]] = {}  # trainer rank -> engine rank -> publisher address
        self._published: dict[int, dict[int, dict[int, str]]] = {}  # version -> trainer rank -> partials
        self._round: Round | None = None
        self._rounds: dict[int, Round] = {}  # decided rounds, the newest KEEP_ROUNDS: what a rank that asks is told
        self._last = -1  # the newest version whose round settled here (or in the decision log)
        self.settled: list[dict] = []  # every round's outcome, oldest first (tests and logs read it)
        self.committed: int | None = None  # the newest version committed (see settled for who confirmed it)
        self._log = DecisionLog(state_dir, plan.hash) if state_dir is not None else None
        if self._log is not None:
            self._restore(self._log.load())
        self._listener = listen(address, **with_token({**LINK_OPTS, **(link_opts or {})}, token))
        self.address = self._listener.address
        self._closed = False
        self._threads = [threading.Thread(target=self._accept_loop, name="wsync-coord-accept", daemon=True),
                         threading.Thread(target=self._main_loop, name="wsync-coord", daemon=True)]
        for t in self._threads:
            t.start()

    def wait_settled(self, version: int, timeout: float | None = None, complete: bool = False) -> dict:
        """The outcome of the first round for `version` or newer (a dict as in `settled`); complete=True: the
        first whose every engine rank confirmed it (an abort is complete as decided)."""
        with self._cv:
            def hit():
                return next((s for s in self.settled if s["version"] >= version and
                             (s["complete"] or not complete)), None)
            if not self._cv.wait_for(lambda: hit() is not None, timeout):
                raise SettleTimeout(f"no round for version {version} settled{' completely' if complete else ''} "
                                    f"within {timeout}s (last: {self.settled[-1] if self.settled else None})")
            return hit()

    def status(self) -> dict:
        """round: the version of the round in progress (None if none) and its phase; committed: the newest
        version committed; unconfirmed: committed version -> engine ranks not yet known to serve it."""
        rnd, rounds = self._round, list(self._rounds.values())
        return {"round": None if rnd is None else {"version": rnd.version, "phase": rnd.phase},
                "committed": self.committed, "settled": self._last,
                "unconfirmed": {r.version: r.unconfirmed(self.N) for r in rounds if r.unconfirmed(self.N)},
                "engine_ranks": sorted(r for (role, r) in list(self._peers) if role == "engine")}

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
        elif peer.role != "engine":
            return
        elif msg.kind == "ask":
            self._answer(peer, v)
        elif msg.kind == "committed":
            self._confirm(peer.rank, v, check_digests(msg.meta, "partials", self.M))
        elif msg.kind in ("ready", "failed") and self._round is not None:
            self._round_message(peer.rank, msg.kind, v, msg.meta)

    def _join(self, peer: "Peer", meta: dict) -> None:
        if peer.role is not None:
            return peer.refuse(f"this link already joined as {peer.name}")
        role = meta.get("role")
        if role not in ("trainer", "engine"):
            return peer.refuse(f"role must be 'trainer' or 'engine', got {role!r:.20}")
        rank = check_int(meta, "rank", 0, self.M if role == "trainer" else self.N)
        if meta.get("plan") != self.plan.hash:
            return peer.refuse(f"{role} rank {rank} follows plan {meta.get('plan')!r:.20}, the coordinator "
                               f"{self.plan.hash}: both sides must route with the same layouts")
        incarnation = meta.get("incarnation")
        incarnation = incarnation if isinstance(incarnation, str) and 16 <= len(incarnation) <= 64 else None
        old = self._peers.get((role, rank))
        if old is not None and old is not peer:
            if old.alive and (incarnation is None or incarnation != old.incarnation):
                # a live rank keeps its slot: whoever else claims it (a second process started with the same
                # rank, or anyone holding the token) waits until that link is dead
                log.error("coordinator: a second %s rank %d from %s turned away; it is joined from %s",
                          role, rank, peer.link.peer, old.link.peer)
                return peer.refuse(f"{role} rank {rank} is already joined from {old.link.peer} on a live link",
                                   kind="busy")
            old.close()  # the same member redialled (or the old link is dead): the new link replaces it
        peer.role, peer.rank, peer.incarnation = role, rank, incarnation
        self._peers[(role, rank)] = peer
        if role == "trainer":
            self._book[rank] = check_digests(meta, "addresses", self.N, maxlen=300)
            for r in range(self.N):
                self._send_book(r)
            if self.settled:  # a trainer rank waiting on a round decided while its link was down
                peer.send("settled", dict(self.settled[-1]))
            return
        self._send_book(rank)
        for past in sorted(self._rounds.values(), key=lambda r: r.version):
            if rank in past.unconfirmed(self.N):  # a rank that holds it staged commits it; any other ignores it
                peer.send("commit", {"version": past.version})
        rnd = self._round  # after the decisions it missed: a prepare would replace the version it holds
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
            else:  # decided: settle without it, as incomplete; it is told again when it rejoins or asks
                rnd.lost.add(peer.rank)
                if rnd.all_reported(self.N):
                    self._settle()

    def _answer(self, peer: "Peer", v: int) -> None:
        """An engine rank holding version v staged and voted ready asks what was decided."""
        past, rnd = self._rounds.get(v), self._round
        if past is not None:
            self._tell(peer, past)
        elif rnd is not None and rnd.version == v:
            if peer.rank not in rnd.ready:  # its ready was lost with its link: it says it again
                peer.send("prepare", {"version": v})
        else:  # never decided here, and no record: the rank keeps serving what it served, and asks again
            peer.send("unknown", {"version": v})

    def _tell(self, peer: "Peer", rnd: Round) -> None:
        if rnd.outcome == "committed":
            peer.send("commit", {"version": rnd.version})
        else:
            peer.send("abort", {"version": rnd.version, "reason": rnd.reason,
                                "keyframe": rnd.keyframe.get(peer.rank, [])})

    def _confirm(self, rank: int, v: int, partials: dict[int, str]) -> None:
        """Engine rank `rank` reports it serves v: every committed round up to v is confirmed for it."""
        rnd = self._round
        if v not in self._rounds and (rnd is None or v >= rnd.version) and v > max(self._rounds, default=-1):
            # a commit decided before this coordinator started, with no record of it here: a rank serving v
            # proves it was decided (only a coordinator says commit), so a rank that holds v staged may too
            log.warning("engine rank %d serves version %d, committed before this coordinator started; "
                        "ranks that hold it staged are told to commit it", rank, v)
            self._rounds[v] = Round(v, {}, 0.0, phase="decided", outcome="committed",
                                    reason=f"learned from engine rank {rank}, which serves it")
            for u in sorted(self._rounds)[:-KEEP_ROUNDS]:
                del self._rounds[u]
            for (role, r), peer in list(self._peers.items()):
                if role == "engine" and r != rank:  # one that holds v staged commits it; any other ignores it
                    peer.send("commit", {"version": v})
        for u, past in sorted(self._rounds.items()):
            if u > v or past.outcome != "committed" or rank in past.confirmed:
                continue
            past.confirmed.add(rank)
            if u == v:
                past.committed[rank] = partials
                self._repair(past, {rank: partials})
            if past is rnd:
                if rnd.all_reported(self.N):
                    return self._settle()
            elif past.doc is not None and not past.unconfirmed(self.N):
                self._update_doc(past)

    def _start(self) -> None:
        """Open a round for the newest version every trainer rank published, if none is running."""
        if self._round is not None:
            return
        full = [v for v, by in self._published.items() if len(by) == self.M and v > self._last]
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
            return self._abort(f"engine rank {rank}: {peer_text(meta.get('reason'))}", {})
        partials = check_digests(meta, "partials", self.M)
        if rnd.phase == "prepare":
            rnd.ready[rank] = partials
            if len(rnd.ready) == self.N:
                self._decide()

    def _decide(self) -> None:
        rnd = self._round
        wrong = rnd.wrong(rnd.ready)
        if wrong:
            return self._abort(f"staged pieces digest differently from what the trainer ranks published: "
                               f"{rnd.describe(wrong)}", wrong)
        rnd.outcome = "committed"
        try:
            self._record(rnd)
        except (OSError, WsyncError) as e:  # no rank has heard anything yet: aborting is still safe
            rnd.outcome = None
            return self._abort(f"the decision could not be recorded in {self._log.path}: {e}", {})
        rnd.phase, rnd.deadline = "commit", time.monotonic() + self.commit_timeout
        self._broadcast("engine", "commit", {"version": rnd.version})

    def _abort(self, reason: str, wrong: dict[int, list[int]]) -> None:
        rnd = self._round
        known = self._rounds.get(rnd.version)
        if known is not None and known is not rnd and known.outcome == "committed":
            return self._commit_again(known, reason, wrong)
        rnd.outcome, rnd.reason, rnd.keyframe = "aborted", reason, wrong
        log.warning("version %d aborted on every engine rank: %s", rnd.version, reason)
        try:
            self._record(rnd)
        except (OSError, WsyncError) as e:  # an abort unrecorded is still safe: unknown means "not committed"
            log.error("version %d: the abort could not be recorded: %s", rnd.version, e)
        for r in range(self.N):
            peer = self._peers.get(("engine", r))
            if peer is not None:
                self._tell(peer, rnd)
        self._settle()

    def _commit_again(self, known: Round, reason: str, wrong: dict[int, list[int]]) -> None:
        """A round run again for a version a rank already serves (learned after a restart with no decision log)
        that would abort: v was committed, and an abort now would leave that rank a version apart. So it is
        committed again: ranks holding it staged commit it, the rest stay unconfirmed until a newer version."""
        rnd = self._round
        log.error("version %d was committed before this coordinator started, so its round here is not aborted "
                  "although %s; ranks that hold it commit it", rnd.version, reason)
        rnd.outcome, rnd.reason = "committed", f"committed before; its round here failed: {reason}"
        rnd.confirmed |= known.confirmed
        rnd.committed.update(known.committed)
        try:
            self._record(rnd)
        except (OSError, WsyncError) as e:  # it was decided before: what is on disk (or not) does not change that
            log.error("version %d: the decision could not be recorded: %s", rnd.version, e)
            self._rounds[rnd.version] = rnd
        rnd.phase, rnd.deadline = "commit", time.monotonic() + self.commit_timeout
        self._broadcast("engine", "commit", {"version": rnd.version})
        for r, srcs in wrong.items():
            peer = self._peers.get(("engine", r))
            if peer is not None:
                peer.send("repair", {"version": rnd.version, "keyframe": srcs})

    def _record(self, rnd: Round) -> None:
        """Before any rank hears the decision: on disk if there is a state dir, and in memory for asking ranks."""
        if self._log is not None:
            self._log.record(rnd.version, rnd.decision())
        self._rounds[rnd.version] = rnd
        for v in sorted(self._rounds)[:-KEEP_ROUNDS]:
            del self._rounds[v]

    def _repair(self, rnd: Round, reports: dict[int, dict[int, str]]) -> None:
        """Ranks whose live tensors read back other than announced take keyframes from those sources; their
        next commit rewrites every piece (a round learned from a rank has no announcement to check against)."""
        if not rnd.expected:
            return
        for r, srcs in rnd.wrong(reports).items():
            peer = self._peers.get(("engine", r))
            if peer is not None:
                peer.send("repair", {"version": rnd.version, "keyframe": srcs})

    def _settle(self) -> None:
        rnd, self._round = self._round, None
        rnd.phase = "decided"
        self._last = rnd.version
        if rnd.outcome == "committed":
            self._repair(rnd, rnd.committed)
            self.committed = rnd.version
        doc = self._describe(rnd)
        if rnd.outcome == "committed" and doc["reason"]:
            log.error("version %d committed, but %s", rnd.version, doc["reason"])
        with self._cv:
            rnd.doc = doc
            self.settled.append(doc)
            del self.settled[:-1000]
            self._cv.notify_all()
        self._broadcast("trainer", "settled", doc)
        self._broadcast("engine", "settled", doc)
        self._start()

    def _describe(self, rnd: Round) -> dict:
        """The round's entry in `settled`, as it stands: a commit is complete once every engine rank confirmed."""
        unconfirmed, digest, reason = rnd.unconfirmed(self.N), None, rnd.reason
        if rnd.outcome == "committed":
            wrong = rnd.wrong(rnd.committed) if rnd.expected else {}
            notes = [rnd.reason] if rnd.reason else []
            if wrong:
                notes.append(f"after the commit, {rnd.describe(wrong)}")
            if unconfirmed:
                notes.append(f"engine ranks {unconfirmed} have not confirmed it (each is told again when it "
                             f"rejoins or asks)")
            reason = "; ".join(notes)
            if rnd.committed:
                digest = engine_digest({r: rank_digest(p) for r, p in rnd.committed.items()})
        return {"version": rnd.version, "outcome": rnd.outcome, "reason": reason, "digest": digest,
                "expected": rnd.engine_digest(), "complete": not unconfirmed, "unconfirmed": unconfirmed}

    def _update_doc(self, rnd: Round) -> None:
        """A committed round whose last unconfirmed rank confirmed: said again, so whoever waits sees it whole."""
        doc = self._describe(rnd)
        log.info("version %d: every engine rank confirmed it", rnd.version)
        with self._cv:
            rnd.doc.clear()
            rnd.doc.update(doc)
            self._cv.notify_all()
        self._broadcast("trainer", "settled", doc)
        self._broadcast("engine", "settled", doc)

    def _restore(self, decisions: dict[int, dict]) -> None:
        """Rounds decided before a restart, from the decision log: the newest is reported unconfirmed by every
        rank until each says again what it serves (they do on joining), and no round runs for it again."""
        for v, d in sorted(decisions.items()):
            self._rounds[v] = Round(v, d["expected"], 0.0, phase="decided", outcome=d["outcome"],
                                    reason=d["reason"], keyframe=d["keyframe"])
        if not decisions:
            return
        rnd = self._rounds[max(decisions)]
        self._last = rnd.version
        if rnd.outcome == "committed":
            self.committed = rnd.version
        rnd.doc = self._describe(rnd)
        self.settled.append(rnd.doc)

    def _tick(self) -> None:
        rnd = self._round
        if rnd is None or time.monotonic() < rnd.deadline:
            return
        if rnd.phase == "prepare":
            missing = [r for r in range(self.N) if r not in rnd.ready]
            self._abort(f"timeout: engine ranks {missing} not ready within {self.timeout:g}s", {})
        else:
            self._settle()

    def _broadcast(self, role: str, kind: str, meta: dict) -> None:
        for (rl, _), peer in list(self._peers.items()):
            if rl == role:
                peer.send(kind, meta)
