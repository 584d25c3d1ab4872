"""A hub's control endpoint: promote, roll back and ask for status from another process (`wsync promote`).

One request per connection, over wsync's tcp transport, whose handshake makes
the caller prove the shared token before a byte of the request is read: a
promotion decides what production serves, so the endpoint refuses to start
without a token, and a caller without it is refused by the transport. Every
field of a request is checked here before the hub sees it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import asdict

from ..errors import WsyncError
from ..fsutil import plain_name
from ..transports import Message, connect, listen
from ..transports.base import with_token
from .hub import ChannelError, Channels, GateRefused, Promotion

log = logging.getLogger("wsync.channels")
LINK_OPTS = {"streams": 1}
OPS = ("promote", "rollback", "status")
MAX_WHY = 1024  # characters of a reason kept in the records
REQUEST_S = 30.0  # seconds a caller has to send its request once connected


class Control:
    """Serves `hub`'s promote / rollback / status at `address` to callers that hold `token`."""

    def __init__(self, hub: Channels, address: str = "tcp://127.0.0.1:0", *, token, flush_timeout: float = 600.0):
        if token is None:
            raise ValueError("a control endpoint needs a token: whoever reaches it could change what production "
                             "serves")
        self.hub, self.flush_timeout = hub, flush_timeout
        self._listener = listen(address, **with_token(LINK_OPTS, token))
        self.address = self._listener.address
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="wsync-channels-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                link = self._listener.accept(timeout=0.5)
            except (WsyncError, OSError):  # a caller that failed the handshake (no token, a wrong one)
                if self._closed:
                    return
                continue
            if link is not None:
                threading.Thread(target=self._serve, args=(link,), name="wsync-channels-call", daemon=True).start()

    def _serve(self, link) -> None:
        try:
            msg = link.recv(timeout=REQUEST_S)
            try:
                reply = Message("ok", self._handle(msg))
            except GateRefused as e:
                reply = Message("refused", {"error": str(e), "record": asdict(e.record)})
            except (WsyncError, ValueError, TypeError) as e:  # ChannelError, a bad name, a bad field
                reply = Message("error", {"error": str(e)})
            link.send(reply)
        except WsyncError as e:
            log.warning("a control call failed: %s", e)
        finally:
            link.close()

    def _handle(self, msg: Message) -> dict:
        m = msg.meta
        if msg.kind != "call" or m.get("op") not in OPS:
            raise ValueError(f"unknown request {msg.kind!r}/{m.get('op')!r:.40}; this endpoint does {list(OPS)}")
        if m["op"] == "status":
            return self.hub.status()
        channel = plain_name(_text(m, "channel", 128), "channel name")
        why = _text(m, "why", MAX_WHY)
        if m["op"] == "promote":
            rec = self.hub.promote(_int(m, "version"), channel=channel, why=why, flush_timeout=self._flush(m))
        else:
            to = None if m.get("to") is None else _int(m, "to")
            rec = self.hub.rollback(channel=channel, to=to, why=why, flush_timeout=self._flush(m))
        return {"record": asdict(rec)}

    def _flush(self, m: dict) -> float | None:
        return self.flush_timeout if m.get("wait") is True else None


def call(address: str, op: str, *, token, timeout: float = 660.0, **args) -> dict:
    """Ask the control endpoint at `address` to do `op` (promote: version, channel, why; rollback: channel,
    to, why; status); returns its answer. GateRefused or ChannelError when the hub said no."""
    if op not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}, got {op!r}")
    link = connect(address, **with_token(LINK_OPTS, token))
    try:
        link.send(Message("call", {"op": op, **args}))
        reply = link.recv(timeout=timeout)
    finally:
        link.close()
    if reply.kind == "refused":
        raise GateRefused(str(reply.meta.get("error")), Promotion(**reply.meta["record"]))
    if reply.kind != "ok":
        raise ChannelError(str(reply.meta.get("error", f"unexpected {reply.kind!r} reply")))
    return reply.meta


def _int(m: dict, key: str) -> int:
    v = m.get(key)
    if type(v) is not int or not 0 <= v < 1 << 62:
        raise ValueError(f"{key} must be a non-negative integer, got {v!r:.40}")
    return v


def _text(m: dict, key: str, most: int) -> str:
    v = m.get(key, "")
    if not isinstance(v, str) or len(v) > most:
        raise ValueError(f"{key} must be text of at most {most} characters")
    return v
