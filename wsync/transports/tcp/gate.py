"""The listener's door: connections that have not finished their handshake, few at once, one deadline each.

Until a peer has proved the token it is a stranger, and a stranger must not be
able to make the listener hold threads or memory: with only a timeout per read,
a peer trickling a byte at a time would keep its handshake alive for ever. So:

* at most ``cap`` connections are in their handshake at once; a newcomer
  beyond that displaces the one that has waited longest, so a flood of
  tricklers cannot lock honest peers out (an honest handshake takes a round
  trip, a trickler holds its place until the deadline);
* a watchdog shuts each connection at its deadline, whatever its admitting
  thread is blocked in (TLS included), so every admitting thread ends in time.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from .link import shut


class Entry:
    """One connection at the door; sock is replaced once TLS wraps it."""

    __slots__ = ("sock", "deadline")

    def __init__(self, sock, deadline: float):
        self.sock, self.deadline = sock, deadline


class Gate:
    def __init__(self, cap: int, timeout: float):
        self.cap, self.timeout = cap, timeout
        self.dropped = 0  # connections shut for lack of time or room (tests and logs read it)
        self._cv = threading.Condition()
        self._waiting: OrderedDict[Entry, None] = OrderedDict()  # oldest first: also earliest deadline first
        self._closed = False
        threading.Thread(target=self._watch, daemon=True, name="wsync-door").start()

    def enter(self, sock) -> Entry:
        """Admit sock to its handshake, displacing the oldest waiting connection if the door is full."""
        with self._cv:
            while len(self._waiting) >= self.cap:
                self._drop(next(iter(self._waiting)))
            entry = Entry(sock, time.monotonic() + self.timeout)
            self._waiting[entry] = None
            self._cv.notify()
            return entry

    def swap(self, entry: Entry, sock) -> None:
        with self._cv:
            entry.sock = sock

    def leave(self, entry: Entry) -> bool:
        """The handshake is over: True if the connection may go on, False if it was already dropped."""
        with self._cv:
            return self._waiting.pop(entry, False) is None

    def close(self) -> None:
        with self._cv:
            self._closed = True
            while self._waiting:
                self._drop(next(iter(self._waiting)))
            self._cv.notify()

    def _drop(self, entry: Entry) -> None:
        del self._waiting[entry]
        self.dropped += 1
        shut(entry.sock)  # wakes its admitting thread, which closes it

    def _watch(self) -> None:
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                while self._waiting and next(iter(self._waiting)).deadline <= now:
                    self._drop(next(iter(self._waiting)))
                first = next(iter(self._waiting), None)
                self._cv.wait(None if first is None else first.deadline - now)
