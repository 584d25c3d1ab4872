"""The publisher's side of one link: greet a subscriber, then feed it versions as they are encoded.

A Sender owns one transport link (one subscriber, or one broadcast group) and
the thread that sends on it; point-to-point links get a second thread that
reads acknowledgements. What to send is decided by the Publisher
(``_next_for``: the catch-up plan in history.py); a Sender only moves buckets
in order and records how far the subscriber has got.
"""
from __future__ import annotations

import logging
import threading
import time

from .errors import TransportError, WsyncError
from .history import EncodedVersion, Keyframe
from .transports import Message

log = logging.getLogger("wsync.sync")
PROTOCOL = 1  # version of the message protocol (hello / welcome / bucket / ack / need / bye)


class Sender:
    """One link (one subscriber, or one broadcast group) and the thread that feeds it."""

    def __init__(self, pub, link):
        self.pub, self.link = pub, link
        self.fanout = getattr(link, "fanout", 1)
        self.lockstep = link.lockstep  # a group link: acks are gathered, never read apart
        self.sent: int | None = None  # newest version fully sent (or held at hello)
        self.sent_checksum: str | None = None
        self.acked: int | None = None  # newest version every member acknowledged
        self.need_keyframe = False
        self.greeted = False  # its hello has arrived
        self.dead = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        t = threading.Thread(target=self._run, name=f"wsync-send-{self.link.peer}", daemon=True)
        self._threads.append(t)
        t.start()

    def stop(self) -> None:
        # a bye only over a link that is up: a plain send on a dropped tcp link waits for it to resume, and
        # the close below (which also releases our threads' sends and receives) would wait behind it
        say = getattr(self.link, "send_while_up", self.link.send)
        try:
            if not self.dead and not self.lockstep:
                say(Message("bye", {}))
        except WsyncError:
            pass
        self._die()
        self.link.close()

    def join(self, deadline: float) -> None:
        """Wait, until time.monotonic() reaches deadline, for this link's threads, which a closed link releases."""
        for t in list(self._threads):
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def _die(self) -> None:
        with self.pub._cv:
            self.dead = True
            self.pub._on_links()  # the versions that waited only for this link are on every live one now
            self.pub._cv.notify_all()

    def _run(self) -> None:
        try:
            self._hello()
            if not self.lockstep:
                t = threading.Thread(target=self._read_acks, name=f"wsync-acks-{self.link.peer}", daemon=True)
                self._threads.append(t)
                t.start()
            while (plan := self.pub._next_for(self)) is not None:
                self._send_plan(*plan)
        except WsyncError as e:
            if not self.pub._closed:
                log.warning("subscriber %s dropped: %s", self.link.peer, e)
        finally:
            self._die()

    def _hello(self) -> None:
        versions, checksums = [], set()
        for _ in range(self.fanout):
            msg = self.link.recv(timeout=self.pub.config.hello_timeout)
            if msg.kind != "hello" or msg.meta.get("protocol") != PROTOCOL:
                raise TransportError(f"{self.link.peer}: expected a protocol {PROTOCOL} hello, got {msg.kind!r}")
            versions.append(msg.meta.get("version"))
            checksums.add(msg.meta.get("checksum"))
        if None in versions or len(set(versions)) > 1 or len(checksums) > 1:
            self.sent, self.sent_checksum = None, None  # members disagree: everyone takes the keyframe
        else:
            self.sent, self.sent_checksum = versions[0], checksums.pop()
        log.info("subscriber %s joined holding version %s", self.link.peer, self.sent)
        with self.pub._cv:
            self.greeted = True
            self.pub._cv.notify_all()
        if not self.lockstep:
            with self.pub._cv:
                newest = self.pub._history.newest
            self.link.send(Message("welcome", {"newest": newest}))

    def _send_plan(self, kf: Keyframe | None, deltas: list[EncodedVersion]) -> None:
        versions = ([self.pub._keyframe_buckets(kf)] if kf is not None else []) + deltas
        for enc in versions:
            if not self._send_version(enc):
                continue
            with self.pub._cv:
                self.sent, self.sent_checksum = enc.version, enc.checksum
                self.pub._on_links()
                self.pub._cv.notify_all()
            if self.lockstep:
                self._gather_acks(enc.version)

    def _send_version(self, enc: EncodedVersion) -> bool:
        for i in range(enc.count):
            msg = self.pub._wait_bucket(enc, i)
            if msg is None:
                return False
            self.link.send(msg)
        return True

    def _gather_acks(self, version: int) -> None:
        need = False
        for _ in range(self.fanout):
            msg = self.link.recv(timeout=None)
            need |= msg.kind == "ack" and bool(msg.meta.get("need_keyframe"))
        with self.pub._cv:
            self.acked = version
            self.pub._took(version, self.fanout)
            self.need_keyframe |= need
            self.pub._cv.notify_all()

    def _read_acks(self) -> None:
        try:
            while not self.dead:
                msg = self.link.recv(timeout=None)
                with self.pub._cv:
                    if msg.kind == "ack":
                        self.acked = msg.meta.get("version")
                        self.pub._took(self.acked, 1)
                        self.need_keyframe |= bool(msg.meta.get("need_keyframe"))
                    elif msg.kind == "need":
                        self.need_keyframe = True
                    elif msg.kind == "bye":
                        self.dead = True
                    self.pub._cv.notify_all()
        except WsyncError:
            pass
        finally:
            self._die()
