"""Channels: one stream of trained versions, followed by engines that want different things from it.

Rollout engines follow the trainer's own publisher (every version: the
``train`` stream). Production engines follow a channel (``prod``, ``canary``
or any name), which serves only the versions promoted onto it. Each channel
is a publisher of its own at its own address, so whatever a subscriber does
(reconnect, take a keyframe, catch up, relay) it can only ever be handed what
that publisher published: an unpromoted version is never on its wire.

A channel's versions on the wire are its **releases** (0, 1, 2, ... and never
reused), so a rollback is one more release that holds older bytes, and the
subscriber's monotone-version machinery (deltas on the release before, digest
check, transaction) carries it like any other: the delta from the current
release back to the older state is a reverse delta, a keyframe where that is
smaller. Every release carries a note (Publisher.publish(note=...)) naming
the trained version it holds, so an engine reports what it serves
(``report``).

The hub holds the states it may be asked for: the newest trained versions
offered to it (candidates) and each channel's last promoted versions (its
rollback history, on disk with ``root``), both bounded in count and bytes.
Every promotion, rollback and gate result is recorded, with when and why, in
``records`` (and ``root/records.jsonl``, from which a hub started again over the
same folder resumes each channel's release numbers and head).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import WsyncError
from ..fsutil import plain_name
from ..sync import Publisher
from .store import NotHeld, StateStore

log = logging.getLogger("wsync.channels")
GATE_CHANNEL = "gate"  # the channel evaluators follow: candidates under test, never served to users
RECORDS = "records.jsonl"


class ChannelError(WsyncError):
    """A channel operation that cannot be done as asked (unknown channel, nothing to roll back to, ...)."""


class GateRefused(ChannelError):
    """A promotion whose gate did not pass; the channel is untouched. .record holds what was recorded."""

    def __init__(self, message: str, record: "Promotion"):
        super().__init__(message)
        self.record = record


@dataclass(frozen=True, kw_only=True)
class Promotion:
    """One decision about a channel, as recorded.

    kind: promote, rollback, abort (a canary sent back to what prod serves) or refused (a gate said no).
    release: the channel's release that serves it (None when refused); version: the trained version;
    gate: the gate's result when one ran ({"passed", "detail", "seconds"})."""

    channel: str
    kind: str
    version: int
    release: int | None
    digest: str
    at: float
    why: str
    gate: dict | None = None


@dataclass(kw_only=True)
class Gate:
    """A check a candidate must pass before it is promoted.

    check(engine) runs on an evaluator: a Subscriber the hub points at its gate channel, writing the
    candidate into `engine`; it returns True/False, or a dict with a "passed" bool and anything else worth
    recording. An exception counts as a failure, recorded with its message."""

    check: Callable[[Any], Any]
    engine: Any
    timeout: float = 600.0  # seconds for the evaluator to hold the candidate


class Channels:
    """Named channels over the versions a trainer offers; one Publisher per channel.

    channels: the channel names (the gate's own is added when a gate is configured). listen: the address
    each channel's publisher listens on (one string for all, port 0 picks a free port each; or a dict by
    name). keep / keep_bytes: promoted versions held per channel for rollback; candidates /
    candidate_bytes: the newest offered versions held for promotion. root: a folder for both and the
    records (what makes them survive a restart). gates: channel -> Gate required to promote onto it.
    token: what every channel's subscribers (and the control endpoint's callers) must prove.
    publisher_opts: passed to each channel's Publisher (codec, tier, keyframe_every, ...)."""

    def __init__(self, channels=("prod",), *, token=None, listen: str | dict = "tcp://127.0.0.1:0",
                 keep: int = 4, keep_bytes: int | None = None, candidates: int = 4,
                 candidate_bytes: int | None = None, root=None, gates: dict[str, Gate] | None = None,
                 **publisher_opts):
        names = list(channels) + ([GATE_CHANNEL] if gates else [])
        for name in names:
            plain_name(name, "channel name")
        if len(set(names)) != len(names):
            raise ValueError(f"channel names must be distinct, got {names}")
        self.token, self.gates = token, dict(gates or {})
        unknown = sorted(set(self.gates) - set(channels))
        if unknown:
            raise ValueError(f"gates name channels this hub does not have: {unknown} (channels: {list(channels)})")
        self.root = Path(root) if root is not None else None
        self._lock = threading.RLock()  # one decision at a time, in the order they were asked for
        self._view = threading.Lock()  # heads and records as status() reads them, even while a gate runs
        self.candidates = StateStore(keep=candidates, max_bytes=candidate_bytes, what="candidate versions",
                                     root=None if self.root is None else self.root / "candidates")
        self._history = {c: StateStore(keep=keep, max_bytes=keep_bytes, what=f"versions kept for {c!r}",
                                       root=None if self.root is None else self.root / "channels" / c)
                         for c in names}
        self.records: list[Promotion] = []
        self._heads: dict[str, Promotion] = {}  # channel -> the record of the release it serves now
        self._releases = {c: -1 for c in names}  # channel -> newest release published
        if self.root is not None:
            self._resume()
        self._pubs: dict[str, Publisher] = {}
        self._evaluator = None
        self._follower = None  # the train stream's Subscriber, with follow()
        try:
            for c in names:
                addr = listen[c] if isinstance(listen, dict) else listen
                self._pubs[c] = Publisher(addr, token=token, **publisher_opts)
            self._republish_heads()
        except BaseException:
            self.close()
            raise

    # -- where engines connect, and what they are told ----------------------------------------

    def address(self, channel: str) -> str:
        return self._pub(channel).address

    @property
    def channels(self) -> list[str]:
        return list(self._pubs)

    def head(self, channel: str) -> Promotion | None:
        """The record of what `channel` serves now (None before its first promotion)."""
        self._pub(channel)
        with self._view:
            return self._heads.get(channel)

    def status(self) -> dict:
        """Per channel: what it serves (version, release, digest, since, why), its subscribers, the versions
        it can roll back to; and the candidates held."""
        with self._view:
            out = {"candidates": self.candidates.versions(), "channels": {}}
            for c, pub in self._pubs.items():
                h = self._heads.get(c)
                out["channels"][c] = {
                    "version": None if h is None else h.version, "release": None if h is None else h.release,
                    "digest": None if h is None else h.digest, "since": None if h is None else h.at,
                    "why": None if h is None else h.why, "subscribers": pub.subscribers,
                    "behind": pub.behind(), "rollback_to": self._history[c].versions()}
            return out

    # -- the trainer's side ---------------------------------------------------------------------

    def offer(self, state, version: int) -> str:
        """Hold a copy of trained version `version` (what was published to the train stream) as a candidate
        for promotion; returns its digest."""
        return self.candidates.put(version, state)

    def follow(self, address: str, *, token=None, **subscriber_opts):
        """Offer every version the publisher at `address` (the train stream) commits here, from a Subscriber
        of its own: the hub as a process apart from the trainer. Returns that Subscriber."""
        from ..shadow import Shadow
        from ..subscriber import Subscriber

        if self._follower is not None:
            raise ChannelError(f"this hub already follows {self._follower.address}")
        shadow = Shadow()

        def offered(c: dict) -> None:
            self.offer(shadow.state, c["version"])

        self._follower = Subscriber(address, engine=shadow, token=token if token is not None else self.token,
                                    on_commit=offered, **subscriber_opts)
        return self._follower

    # -- decisions ------------------------------------------------------------------------------

    def promote(self, version: int, *, channel: str = "prod", why: str = "", gate: Gate | None = None,
                flush_timeout: float | None = None) -> Promotion:
        """Make `channel` serve trained version `version` (a candidate, or one the channel held before).

        Idempotent: promoting what the channel already serves records nothing and returns its record. The
        channel's gate (or `gate`) runs first; GateRefused, with the channel untouched, if it does not pass.
        flush_timeout: also wait until every engine connected to the channel serves it."""
        self._decidable(channel)
        _check_version(version)
        with self._lock:
            head = self._heads.get(channel)
            if head is not None and head.version == version:
                return head
            state, dg = self._state_of(version, channel)
            gate = gate if gate is not None else self.gates.get(channel)
            result = self._run_gate(gate, state, version, why) if gate is not None else None
            if result is not None and not result["passed"]:
                rec = Promotion(channel=channel, kind="refused", version=version, release=None, digest=dg,
                                at=time.time(), why=why, gate=result)
                self._record(rec)
                raise GateRefused(f"version {version} did not pass {channel!r}'s gate ({result['detail']}); "
                                  f"{channel!r} still serves {None if head is None else head.version}", rec)
            rec = self._release(channel, "promote", version, state, dg, why, result)
        if flush_timeout is not None:
            self._pub(channel).flush(flush_timeout)
        return rec

    def rollback(self, *, channel: str = "prod", to: int | None = None, why: str = "",
                 flush_timeout: float | None = None) -> Promotion:
        """Make `channel` serve an earlier version again: `to`, or the one it served before its current one.

        The exact bytes of that version, as one more release (digest-checked and transactional on every
        engine like any other); no gate runs: it served before."""
        self._decidable(channel)
        with self._lock:
            head = self._heads.get(channel)
            if to is None:
                to = self._previous(channel)
            _check_version(to)
            if head is not None and head.version == to:
                return head
            served = sorted({r.version for r in self.records if r.channel == channel and r.release is not None})
            if to not in served:  # a rollback skips the gate: only what passed onto this channel before
                raise ChannelError(f"{channel!r} never served version {to} (it served {served or 'nothing'}); "
                                   "promote() it instead, through the channel's gate")
            try:
                state, dg = self._history[channel].get(to)
            except NotHeld as e:
                raise ChannelError(f"cannot roll {channel!r} back to version {to}: {e}; keep= sets how many "
                                   "promoted versions each channel keeps") from None
            rec = self._release(channel, "rollback", to, state, dg, why, None)
        if flush_timeout is not None:
            self._pub(channel).flush(flush_timeout)
        return rec

    def stage(self, version: int, *, canary: str = "canary", to: str = "prod", hold_s: float = 0.0,
              check: Callable[[], bool | None] | None = None, max_hold_s: float | None = None,
              poll_s: float = 0.5, why: str = "") -> "Rollout":
        """Promote onto `canary` now (through its gate), hold, then onto `to` (through its gate).

        The hold lasts at least hold_s seconds and, with `check`, until check() says True (False aborts;
        None: not decided yet, asked again every poll_s); past max_hold_s undecided, it aborts. An abort
        sends the canary back to what `to` serves. Returns the Rollout at once; its wait() gives the end."""
        self._decidable(canary), self._decidable(to)
        self.promote(version, channel=canary, why=why)
        r = Rollout(self, version, canary=canary, to=to, hold_s=hold_s, check=check, max_hold_s=max_hold_s,
                    poll_s=poll_s, why=why)
        r._start()
        return r

    # -- inside ---------------------------------------------------------------------------------

    def _pub(self, channel: str) -> Publisher:
        pub = self._pubs.get(channel) if isinstance(channel, str) else None
        if pub is None:
            raise ChannelError(f"no channel {channel!r} here (channels: {list(self._pubs)})")
        return pub

    def _align(self, channel: str, to: str, why: str) -> Promotion | None:
        """Make `channel` serve what `to` serves (an aborted canary); None if `to` serves nothing."""
        with self._lock:
            head = self._heads.get(to)
            if head is None:
                return None
            state, dg = self._state_of(head.version, to)
            return self._release(channel, "abort", head.version, state, dg, why, None)

    def _decidable(self, channel: str) -> None:
        self._pub(channel)
        if channel == GATE_CHANNEL and self.gates:
            raise ChannelError(f"{GATE_CHANNEL!r} carries the candidates the gates test; promote onto another channel")

    def _state_of(self, version: int, channel: str):
        """(Under the lock.) The state of `version`: a candidate, or one this channel or another still holds."""
        others = [s for c, s in self._history.items() if c != channel]
        for store in [self.candidates, self._history[channel], *others]:
            try:
                return store.get(version)
            except NotHeld:
                continue
        held = sorted(set(self.candidates.versions()).union(*(s.versions() for s in self._history.values())))
        raise ChannelError(f"version {version} is not held here (candidates and promoted versions held: "
                           f"{held or 'none'}); offer() it first, or keep more (candidates=, keep=)")

    def _previous(self, channel: str) -> int:
        """The version `channel` served before the one it serves now."""
        head = self._heads.get(channel)
        if head is None:
            raise ChannelError(f"{channel!r} serves nothing yet: nothing to roll back")
        for rec in reversed(self.records):
            if rec.channel == channel and rec.release is not None and rec.release < head.release \
                    and rec.version != head.version:
                return rec.version
        raise ChannelError(f"{channel!r} has served only version {head.version}: nothing earlier to roll back to")

    def _release(self, channel, kind, version, state, dg, why, gate) -> Promotion:
        """(Under the lock.) Publish `state` as the channel's next release, keep it for rollback, record it."""
        release = self._releases[channel] + 1
        rec = Promotion(channel=channel, kind=kind, version=version, release=release, digest=dg,
                        at=time.time(), why=why, gate=gate)
        self._history[channel].put(version, state, checksum=dg, owned=True)
        # recorded (on disk) before any engine can hear it: a hub restarted over root never numbers
        # another state with a release an engine already holds
        self._record(rec)
        self._pubs[channel].publish(state, release, frozen=True, note=_note(rec))
        self._releases[channel] = release
        with self._view:
            self._heads[channel] = rec
        log.info("%s now serves version %s (release %s, %s): %s", channel, version, release, kind, why or "-")
        return rec

    def _run_gate(self, gate: Gate, state, version: int, why: str) -> dict:
        """(Under the lock.) The candidate on the gate channel, the evaluator following it, check() on it."""
        from ..subscriber import Subscriber

        if self._evaluator is None or self._evaluator.engine is not gate.engine:
            if self._evaluator is not None:
                self._evaluator.close()
            self._evaluator = Subscriber(self.address(GATE_CHANNEL), engine=gate.engine, token=self.token)
        release = self._releases[GATE_CHANNEL] + 1
        t0 = time.perf_counter()
        self._pubs[GATE_CHANNEL].publish(state, release, frozen=True,
                                         note={"channel": GATE_CHANNEL, "version": version, "release": release})
        self._releases[GATE_CHANNEL] = release
        try:
            self._evaluator.wait_for(release, timeout=gate.timeout)
            got = gate.check(gate.engine)
            passed, detail = (bool(got.get("passed")), got) if isinstance(got, dict) else (got is True, got)
        except Exception as e:  # noqa: BLE001 - the user's eval: its failure is the gate's answer
            passed, detail = False, f"{type(e).__name__}: {e}"
        return {"passed": passed, "detail": _plain(detail), "seconds": round(time.perf_counter() - t0, 6)}

    def _record(self, rec: Promotion) -> None:
        with self._view:
            self.records.append(rec)
        if self.root is not None:
            with open(self.root / RECORDS, "a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(rec), sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def _resume(self) -> None:
        """Records and heads from an earlier hub over the same root (its files checked by the stores)."""
        path = self.root / RECORDS
        if not path.exists():
            return
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                rec = Promotion(**json.loads(line))
            except (TypeError, ValueError) as e:
                raise ChannelError(f"{path}:{n} is not a record this hub wrote ({e}); move the file away to "
                                   "start without the history") from None
            self.records.append(rec)
            if rec.channel in self._releases and rec.release is not None:
                self._releases[rec.channel] = max(self._releases[rec.channel], rec.release)
                self._heads[rec.channel] = rec

    def _republish_heads(self) -> None:
        """A resumed hub serves each channel's head again, as a release after every earlier one: a
        subscriber that held the last one gets a delta to the same bytes (or nothing to apply)."""
        for c, head in list(self._heads.items()):
            if c == GATE_CHANNEL:
                continue
            try:
                state, dg = self._history[c].get(head.version)
            except NotHeld:
                log.warning("%s served version %s, which %s no longer holds: it serves nothing until the next "
                            "promotion", c, head.version, self.root)
                del self._heads[c]
                continue
            release = self._releases[c] + 1
            rec = Promotion(channel=c, kind=head.kind, version=head.version, release=release, digest=dg,
                            at=head.at, why=head.why, gate=head.gate)
            self._pubs[c].publish(state, release, frozen=True, note=_note(rec))
            self._releases[c], self._heads[c] = release, rec

    def close(self) -> None:
        for sub in (getattr(self, "_follower", None), getattr(self, "_evaluator", None)):
            if sub is not None:
                sub.close()
        for pub in getattr(self, "_pubs", {}).values():
            pub.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Rollout:
    """A staged promotion under way (Channels.stage): canary now, `to` after the hold, or back on abort."""

    def __init__(self, hub: Channels, version: int, *, canary, to, hold_s, check, max_hold_s, poll_s, why):
        self.hub, self.version, self.canary, self.to = hub, version, canary, to
        self.hold_s, self.check, self.max_hold_s, self.poll_s, self.why = hold_s, check, max_hold_s, poll_s, why
        self.state = "holding"  # then promoted, aborted, or failed (promotion onto `to` raised: see .error)
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._abort: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"wsync-rollout-{version}", daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def abort(self, why: str = "aborted") -> None:
        """Stop the hold: the canary goes back to what `to` serves (if the rollout is still holding)."""
        with self._cv:
            if self._abort is None:
                self._abort = why
            self._cv.notify_all()
        self._thread.join()

    def wait(self, timeout: float | None = None) -> str:
        """The rollout's end: promoted, aborted or failed (ChannelError if still holding after timeout)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ChannelError(f"the rollout of version {self.version} is still holding after {timeout}s")
        return self.state

    def _run(self) -> None:
        t0, verdict, why = time.monotonic(), None, None
        while True:
            with self._cv:
                if self._abort is not None:
                    why = self._abort
                    break
            held = time.monotonic() - t0
            if held >= self.hold_s:
                verdict, why = (True, None) if self.check is None else self._ask()
                if verdict is not None:
                    break
                if self.max_hold_s is not None and held >= self.max_hold_s:
                    why = f"undecided after {self.max_hold_s}s"
                    break
            with self._cv:  # abort() wakes it
                if self._abort is None:
                    self._cv.wait(self.poll_s if held >= self.hold_s else min(self.poll_s, self.hold_s - held))
        try:
            if verdict is True:
                self.hub.promote(self.version, channel=self.to, why=self.why)
                self.state = "promoted"
                return
            self._send_canary_back(why or "the check failed")
            self.state = "aborted"
        except BaseException as e:  # noqa: BLE001 - kept for wait()'s caller, who decides
            self.error, self.state = e, "failed"

    def _ask(self) -> tuple[bool | None, str | None]:
        """The check's verdict (True, False, None: undecided) and, for a failure, why."""
        try:
            got = self.check()
        except Exception as e:  # noqa: BLE001 - a failing metric is a failed check
            return False, f"the check raised {type(e).__name__}: {e}"
        if got is None:
            return None, None
        return (True, None) if got is True else (False, f"the check said {got!r}")

    def _send_canary_back(self, why: str) -> None:
        if self.hub._align(self.canary, self.to, why) is None:
            log.warning("aborted rollout of version %s: %s serves nothing to send %s back to", self.version,
                        self.to, self.canary)


def report(sub) -> dict:
    """What a Subscriber following a channel serves: channel, trained version, release, since when (the
    commit's wall clock), the trained version's digest (snapshot.digest, as the hub recorded it) and the
    version digest its commit check verified the engine's tensors against. Off a channel (a plain publisher),
    version is the subscriber's own and channel, release and digest are None."""
    last = sub.stats.last
    note = (last.note if last is not None else None) or {}
    return {"channel": note.get("channel"), "version": note.get("version", sub.version),
            "release": sub.version if note else None, "digest": note.get("digest"),
            "checked": None if last is None else last.checksum, "since": None if last is None else last.at}


def channel_for(engine_id: str, *, canary=0.0, canary_channel: str = "canary", default: str = "prod") -> str:
    """Which channel an engine follows: canary_channel if it is named in `canary` (a set of engine ids) or
    falls in the `canary` fraction (a float in [0, 1], by a hash of its id: the same engines every time)."""
    import hashlib

    if isinstance(canary, (int, float)) and not isinstance(canary, bool):
        if not 0.0 <= canary <= 1.0:
            raise ValueError(f"a canary fraction is in [0, 1], got {canary}")
        h = int.from_bytes(hashlib.sha256(engine_id.encode()).digest()[:8], "big") / 2 ** 64
        return canary_channel if h < canary else default
    return canary_channel if engine_id in canary else default


def _note(rec: Promotion) -> dict:
    return {"channel": rec.channel, "version": rec.version, "release": rec.release, "kind": rec.kind,
            "digest": rec.digest, "at": rec.at, "why": rec.why[:512]}


def _check_version(v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"a version is a non-negative int, got {v!r}")


def _plain(x):
    """A gate's detail as plain JSON (anything else as its text), so a record always serializes."""
    try:
        json.dumps(x, allow_nan=False)
        return x
    except (TypeError, ValueError):
        return str(x)
