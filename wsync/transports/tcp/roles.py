"""The two ends of a tcp:// link: the dialling side brings epochs up, the listening side admits them.

The subscriber (dialling) side opens every connection of a link: first "up"
stream 0 with ``op`` open or resume (carrying what it holds), then the other
2N-1 connections with ``op`` join. The listening side starts the epoch when
the last one has joined. After a drop only the dialling side acts: it retries
with growing pauses until ``resume_window`` runs out, while the listening side
waits that long for it and then fails the link. With a token, each
connection's handshake leaves it its own record MAC key (auth.Keys.frames),
handed to the epoch with its socket.
"""
from __future__ import annotations

import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ...errors import TransportError
from .auth import Refused, client_handshake, reply, tune
from .link import TcpLink, shut


class ClientLink(TcpLink):
    def __init__(self, cfg, host: str, port: int, token=None, tls=None):
        super().__init__(cfg, peer=f"{host}:{port}", session=secrets.token_hex(16))
        self.host, self.port, self.token, self.tls = host, port, token, tls
        self._attempt = 0  # epochs tried; every attempt takes a new number so stale joins are refused

    def bring_up(self, resume: bool, deadline: float) -> None:
        with self.cv:
            self._attempt = max(self._attempt, self.epoch) + 1
            e, held = self._attempt, self.inbox.state()
        n, socks, keys = self.cfg.streams, [], {}
        base = {"session": self.session, "epoch": e}
        try:
            s0, rep, keys[s0] = self._dial({**base, "op": "resume" if resume else "open", "dir": "up", "index": 0,
                                            "streams": n, "state": held}, deadline)
            socks.append(s0)
            joins = [("up", k) for k in range(1, n)] + [("down", k) for k in range(n)]
            with ThreadPoolExecutor(max_workers=min(8, len(joins) or 1)) as pool:  # WAN: dial in parallel
                futs = [pool.submit(self._dial, {**base, "op": "join", "dir": d, "index": k}, deadline)
                        for d, k in joins]
                results = [f.exception() or f.result() for f in futs]
            keys.update((r[0], r[2]) for r in results if not isinstance(r, BaseException))
            results = [r if isinstance(r, BaseException) else r[0] for r in results]
            socks.extend(r for r in results if not isinstance(r, BaseException))
            errors = sorted((r for r in results if isinstance(r, BaseException)), key=lambda x: not isinstance(x, Refused))
            if errors:
                raise errors[0]
            dialled = results
            outs, ins = [s0] + dialled[: n - 1], dialled[n - 1:]
            if not isinstance(rep.get("state"), str):
                raise TransportError(f"{self.peer} sent no resume state")
            with self.cv:
                self._start(e, outs, ins, rep["state"], keys)
        except BaseException:
            for s in set(socks):
                shut(s)
                s.close()
            raise

    def _dial(self, req: dict, deadline: float):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"ran out of time connecting to {self.peer}")
        try:
            info = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        except OSError as e:
            raise TransportError(f"cannot resolve {self.host}: {e}") from None
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        try:
            tune(sock, self.cfg)  # before connect: the window scale is fixed by the SYN
            sock.settimeout(min(self.cfg.connect_timeout, left))
            sock.connect(info[4])
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            hs_deadline = time.monotonic() + min(self.cfg.handshake_timeout, left)
            rep, keys = client_handshake(sock, self.token, req, self.peer, hs_deadline)
            sock.settimeout(None)
            return sock, rep, (keys.frames(req["dir"]) if keys is not None else None)
        except OSError as e:
            sock.close()
            raise TransportError(f"cannot connect to {self.peer}: {e}") from None
        except BaseException:
            sock.close()
            raise

    def _on_break(self, e: int) -> None:
        threading.Thread(target=self._reconnect, daemon=True, name="wsync-resume").start()

    def _reconnect(self) -> None:
        self._reap()
        window = self.cfg.resume_window
        deadline, delay, last = time.monotonic() + window, 0.05, None
        while True:
            with self.cv:
                if self.state != "broken":
                    return
            try:
                return self.bring_up(True, deadline)
            except Refused as ex:
                return self._fail(TransportError(f"{self.peer} refused to resume the link: {ex}"))
            except TransportError as ex:
                last = ex
            if time.monotonic() + delay >= deadline:
                return self._fail(TransportError(f"lost the link to {self.peer} and could not resume it within "
                                                 f"resume_window={window}s (last error: {last})"))
            time.sleep(delay)
            delay = min(2 * delay, 1.0)


class ServerLink(TcpLink):
    def __init__(self, cfg, peer: str, session: str, on_ready, on_end):
        super().__init__(cfg, peer=peer, session=session, on_end=on_end)
        self._pending: dict | None = None  # the epoch being joined: e, ins, outs, peer state
        self._on_ready = on_ready

    def attach(self, sock, req: dict, keys) -> None:
        """Take one authenticated connection of this link (Refused if it does not fit); keys: its
        handshake's auth.Keys (None without a token)."""
        if req["op"] == "join":
            return self._join(sock, req, keys)
        with self.cv:
            if self.state in ("failed", "closed"):
                raise Refused("that link has ended")
            top = max(self.epoch, self._pending["e"] if self._pending else 0)
            if req["epoch"] <= top:
                raise Refused(f"stale epoch {req['epoch']} (at {top})")
            if self.state == "up":  # the subscriber saw the drop first
                self._break(self.epoch, TransportError("subscriber reconnected"))
        self._reap()  # the old epoch's readers must be gone before we say what we hold
        with self.cv:
            self._drop_pending()
            n = req["streams"]
            self._pending = {"e": req["epoch"], "ins": [sock] + [None] * (n - 1), "outs": [None] * n,
                             "state": req["state"], "keys": {}}
            self._keep_key(sock, req, keys)
            reply(sock, keys, state=self.inbox.state())
            if self.state == "connecting":  # a subscriber that never finishes joining is dropped
                t = threading.Timer(2 * self.cfg.handshake_timeout, self._abandon, (req["epoch"],))
                t.daemon = True
                t.start()
            self._maybe_start()

    def _abandon(self, e: int) -> None:
        with self.cv:
            if self.state == "connecting" and self._pending and self._pending["e"] == e:
                self._fail(TransportError(f"{self.peer} did not finish opening its {self.cfg.streams} streams"))

    def _keep_key(self, sock, req: dict, keys) -> None:
        if keys is not None:
            self._pending["keys"][sock] = keys.frames(req["dir"])

    def _join(self, sock, req: dict, keys) -> None:
        with self.cv:
            p = self._pending
            if p is None or req["epoch"] != p["e"]:
                raise Refused(f"no bring-up of epoch {req['epoch']} in progress")
            slots = p["ins"] if req["dir"] == "up" else p["outs"]
            k = req["index"]
            if not 0 <= k < len(slots) or slots[k] is not None:
                raise Refused(f"bad or repeated stream index {k}")
            slots[k] = sock
            self._keep_key(sock, req, keys)
            reply(sock, keys)
            self._maybe_start()

    def _maybe_start(self) -> None:
        p = self._pending
        if any(s is None for s in p["ins"] + p["outs"]):
            return
        self._pending = None
        first = self.state == "connecting"
        try:
            self._start(p["e"], p["outs"], p["ins"], p["state"], p["keys"])
        except TransportError as ex:
            self._fail(ex)
            raise
        if first:
            self._on_ready(self)

    def _drop_pending(self) -> None:
        if self._pending:
            for s in self._pending["ins"] + self._pending["outs"]:
                if s is not None:
                    shut(s)
                    s.close()
        self._pending = None

    def _on_break(self, e: int) -> None:
        t = threading.Timer(self.cfg.resume_window, self._expire, (e,))
        t.daemon = True
        t.start()

    def _expire(self, e: int) -> None:
        with self.cv:
            if self.epoch == e and self.state == "broken":
                self._fail(TransportError(f"{self.peer} did not reconnect within resume_window="
                                          f"{self.cfg.resume_window}s"))

    def _finish(self) -> None:
        self._drop_pending()
        super()._finish()
