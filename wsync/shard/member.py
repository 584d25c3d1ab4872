"""The links of the commit protocol: a rank's link to the coordinator (Member), the coordinator's end of one
(Peer), and the checks on what arrives over them.

Every rank (trainer and engine) holds one ``Member`` link to the coordinator
(commit.py). It rides the tcp transport, so the token authenticates both
ends and every record is MAC'd; messages are JSON meta with no blobs (never
pickle). One stream is enough for a few hundred bytes per version, and a short
resume window lets the coordinator see a dead rank within seconds instead of
the transport's default 30 s: a round waiting on a rank that is gone would
otherwise hold every engine rank's version for that long.

A Member redials when its link drops and joins again (the coordinator then
sends it what it needs: the address book, the round in progress, a decision
it missed), so a coordinator hiccup costs a round, not the ranks.

Every join carries the Member's *incarnation*, random bits drawn once per
Member. The coordinator gives a rank slot held by a live link only to the same
incarnation (the member redialling before the coordinator saw its old link
die); any other join for that rank, a second process started with the same
rank or anyone else holding the token, is answered ``busy`` and keeps
redialling until the slot's link is dead. A token shared by every rank cannot
bind a rank to a credential (whoever holds it can derive any rank's), so this
rule, not a derived key, is what keeps a live rank in its slot; the
incarnation rides inside the authenticated link (private too under TLS).
"""
from __future__ import annotations

import logging
import queue
import secrets
import threading

from ..errors import TransportError, WsyncError, peer_text
from ..transports import Message, TransportTimeout, connect
from ..transports.base import with_device, with_token

log = logging.getLogger("wsync.shard")

# a coordinator link: one stream (a few hundred bytes a version), and a dead peer noticed in seconds
LINK_OPTS = {"streams": 1, "resume_window": 2.0}


class CoordinatorError(WsyncError):
    """The coordinator refused this rank (another plan, a rank out of range), or could not be reached."""


def check_int(meta: dict, key: str, lo: int = 0, hi: int | None = None) -> int:
    """meta[key] as an int in [lo, hi): a peer's message is untrusted."""
    v = meta.get(key)
    if type(v) is not int or v < lo or (hi is not None and v >= hi):
        raise TransportError(f"coordinator message: {key!r} must be an int in [{lo}, {hi}), got {v!r:.40}")
    return v


def check_digests(meta: dict, key: str, hi: int, maxlen: int = 64) -> dict[int, str]:
    """meta[key] as {rank: string} (digests, or addresses): JSON object keys are strings, so ranks travel as
    decimal strings."""
    d = meta.get(key)
    if not isinstance(d, dict) or len(d) > hi:
        raise TransportError(f"coordinator message: {key!r} must be an object of at most {hi} digests")
    out = {}
    for k, v in d.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < hi and isinstance(v, str) and len(v) <= maxlen):
            raise TransportError(f"coordinator message: {key!r} holds {k!r:.20}: {v!r:.70}, not rank: string")
        out[int(k)] = v
    return out


def digests_doc(d: dict[int, str]) -> dict[str, str]:
    return {str(k): v for k, v in d.items()}


class Member:
    """One rank's link to the coordinator. on_message(msg) runs on this link's reader thread; on_join() there
    too, each time the link comes up (after the join went out)."""

    def __init__(self, address: str, join: dict, on_message, *, token=None, link_opts: dict | None = None,
                 retry_s: float = 0.5, on_join=None):
        self.incarnation = secrets.token_hex(16)
        self.address, self.join = address, {**join, "incarnation": self.incarnation}
        self._on_message, self._retry_s, self._on_join = on_message, retry_s, on_join
        self._opts = with_device(address, with_token({**LINK_OPTS, **(link_opts or {})}, token))
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()
        self._link = None
        self._closed = False
        self.error: WsyncError | None = None  # why the last dial failed, or the coordinator's refusal
        self.refused = False
        self._busy = False  # the last join was turned away: the rank's slot is held by a live link
        self._thread = threading.Thread(target=self._run, name="wsync-shard-member", daemon=True)
        self._thread.start()

    def send(self, kind: str, meta: dict) -> bool:
        """Send now if the link is up; False (and a log line) if it is not: the coordinator's round then times
        out, which is what a lost message must cost."""
        link = self._link
        if link is None:
            log.warning("no link to the coordinator %s: %s %s not sent", self.address, kind, meta.get("version"))
            return False
        with self._send_lock:
            try:
                link.send(Message(kind, meta))
                return True
            except WsyncError as e:
                log.warning("could not send %s to the coordinator: %s", kind, e)
                return False

    @property
    def up(self) -> bool:
        return self._link is not None

    def wait_up(self, timeout: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._link is not None or self.refused or self._closed, timeout):
                raise CoordinatorError(f"no link to the coordinator {self.address} within {timeout:g}s: {self.error}")
            if self.refused:
                raise self.error

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        link = self._link
        if link is not None:
            link.close()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._closed and not self.refused:
            try:
                link = connect(self.address, **self._opts)
            except WsyncError as e:
                self.error = e
            else:
                self._serve(link)
            with self._cv:
                self._cv.wait_for(lambda: self._closed, timeout=self._retry_s * (4 if self._busy else 1))

    def _who(self) -> str:
        return f"{self.join.get('role')} rank {self.join.get('rank')}"

    def _serve(self, link) -> None:
        try:
            link.send(Message("join", self.join))
            with self._cv:
                self._link, self.error, self._busy = link, None, False
                self._cv.notify_all()
            if self._on_join is not None:  # what this rank must say again to a coordinator that restarted
                self._on_join()
            while not self._closed:
                try:
                    msg = link.recv(timeout=0.5)
                except TransportTimeout:
                    continue
                if msg.kind in ("refused", "busy"):
                    said = "refused" if msg.kind == "refused" else "turned away"
                    self.error = CoordinatorError(f"the coordinator {said} {self._who()}: "
                                                  f"{peer_text(msg.meta.get('reason'))}")
                    log.error("%s%s", self.error, "; trying again" if msg.kind == "busy" else "")
                    # busy: the slot is held by a live link, not this one's to take now; maybe once that dies
                    self.refused, self._busy = msg.kind == "refused", msg.kind == "busy"
                    return
                self._on_message(msg)
        except WsyncError as e:
            self.error = e
            if not self._closed:
                log.warning("link to the coordinator %s lost (%s); redialling", self.address, e)
        finally:
            with self._cv:
                self._link = None
                self._cv.notify_all()
            link.close()


class Peer:
    """One member's link: a reader thread that posts its messages as events, and a writer thread, so a
    link that stalls never holds the coordinator's decisions."""

    def __init__(self, link, events: queue.Queue):
        self.link, self.events = link, events
        self.role: str | None = None
        self.rank = -1
        self.incarnation: str | None = None  # the joined Member's random bits (member.Member)
        self._out: queue.Queue = queue.Queue()
        self._dead = False

    @property
    def name(self) -> str:
        return f"{self.role} rank {self.rank}" if self.role else str(self.link.peer)

    def start(self) -> None:
        threading.Thread(target=self._read, name="wsync-coord-rx", daemon=True).start()
        threading.Thread(target=self._write, name="wsync-coord-tx", daemon=True).start()

    def send(self, kind: str, meta: dict) -> None:
        self._out.put(Message(kind, meta))

    @property
    def alive(self) -> bool:
        """Its link is up (or still joining): a link in its resume window, or ended, is not."""
        return not self._dead and getattr(self.link, "state", "up") in ("up", "connecting")

    def refuse(self, reason: str, kind: str = "refused") -> None:
        """Say why (kind "refused": for good; "busy": try again later), then end the link."""
        log.error("coordinator %s %s: %s", "refused" if kind == "refused" else "turned away", self.link.peer, reason)
        self.send(kind, {"reason": reason})
        self._out.put(None)

    def close(self) -> None:
        self._dead = True
        self._out.put(None)

    def _read(self) -> None:
        try:
            while not self._dead:
                if getattr(self.link, "state", "up") not in ("up", "connecting"):
                    break  # a dead process: its link is broken now, failed only after the resume window
                try:
                    msg = self.link.recv(timeout=0.2)
                except TransportTimeout:
                    continue
                self.events.put(("msg", self, msg))
        except Exception as e:
            log.info("coordinator: link to %s ended: %s", self.name, e)
        finally:
            self._dead = True
            self._out.put(None)
            self.events.put(("lost", self, None))

    def _write(self) -> None:
        try:
            while (msg := self._out.get()) is not None:
                self.link.send(msg)
        except Exception as e:
            log.info("coordinator: cannot send to %s: %s", self.name, e)
        finally:
            self._dead = True
            self.link.close()
