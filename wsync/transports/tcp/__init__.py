"""tcp:// — the transport for links between hosts: racks apart or across a WAN.

Built for long fat pipes and for links that drop:

* **several streams** per link (``streams=4``): each message is cut into frames
  (at most ``frame_bytes``, 4 MiB; smaller for messages that would give a
  stream fewer than 16, see ``outbox.frame_size``) that any stream may
  carry, each with its own header (message, blob, offset, length, xxh3-64),
  and reassembled in place. A stream takes its next frame once its unsent
  bytes fall below ``link.NOTSENT_LOWAT``, so faster streams carry more. A message
  of at most 1 MiB (a delta bucket) goes whole to the lowest-numbered free
  stream, so a trickle of small versions keeps one connection's window open;
  with 3 or more streams the frames of large messages skip stream 0 (after
  its first MiB, which opens its window), so a keyframe never cuts the rate
  that connection learned (``outbox.take``);
* **large socket buffers** (``sndbuf``, and ``auth.RCVBUF``: 16 MiB) and TCP_NODELAY;
  where the kernel has them (Linux >= 6.15), a 50 ms minimum retransmission
  timeout (``rto_min``) and ACKs delayed at most 10 ms (``delack_max``);
* **resume**: if connections drop, the subscriber reconnects within
  ``resume_window`` seconds and the link carries on from the last good frame,
  with nothing lost or repeated; after the window both sides see TransportError;
* **auth**: with ``token=...`` every connection runs an HMAC-SHA256
  challenge-response both ways (a token of fewer than 16 bytes is refused:
  see tokens.py), and a peer without the token is refused and
  logged (logger ``wsync.transports.tcp``) before ``accept()`` ever sees it.
  Every record after the handshake then carries a keyed-BLAKE3 MAC under a
  key of that connection (mac.py), so a relay without the token cannot change,
  drop, reorder or replay a byte unseen, TLS or not: the link fails instead.
  **Without a token on the listener anyone who reaches the port may connect.**
* **strangers are cheap**: a connection's handshake has one deadline
  (``handshake_timeout``), at most ``max_handshakes`` run at once (gate.py), and
  nothing is allocated for a peer before it proves the token;
* **bounded messages**: a listener accepts messages of at most 16 MiB by
  default (in wsync it is the publisher: subscribers only send it small
  control messages), a dialler up to 64 GiB (buckets); ``max_message`` sets it,
  and ``TcpLink.limit`` narrows it once the receiver knows what to expect.
* **TLS** with ``tls=`` an ``ssl.SSLContext`` or a ``TlsConfig``/dict of files.

Usage (through ``wsync.transports``)::

    token = wsync.tokens.load()                        # WSYNC_TOKEN / WSYNC_TOKEN_FILE (hex, >= 16 bytes)
    lst = listen("tcp://0.0.0.0:7070", token=token)
    link = connect("tcp://trainer:7070?streams=8", token=token)

Options come from address parameters (``?streams=8&resume_window=60``) and
keyword arguments (which win). ``send`` returns once every byte is in the
kernel; the link keeps a reference to the blobs until the peer acknowledges
them, so call ``link.flush()`` before changing a buffer you sent.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
from dataclasses import dataclass

from ...errors import TransportError, peer_text
from ...tokens import check as check_token
from .. import options
from ..base import Address
from .auth import Refused, TlsConfig, client_context, reply, server_context, server_handshake, tune
from .gate import Gate
from .link import TcpLink, shut
from .mac import Forged
from .roles import ClientLink, ServerLink

__all__ = ["Forged", "TcpConfig", "TcpListener", "TcpLink", "TlsConfig", "connect", "listen"]

log = logging.getLogger("wsync.transports.tcp")


@dataclass(kw_only=True)
class TcpConfig:
    streams: int = 4  # TCP connections per direction; a message's frames spread over them (dialling side decides)
    frame_bytes: int = 4 << 20  # bytes per frame: the unit of striping, checksumming and resending
    sndbuf: int = 16 << 20  # SO_SNDBUF per connection (0: kernel autotuning)
    resume_window: float = 30.0  # seconds a dropped link may take to reconnect before TransportError
    connect_timeout: float = 10.0  # seconds per TCP connect attempt
    handshake_timeout: float = 10.0  # seconds for a connection's whole handshake (TLS + token + join), in total
    max_handshakes: int = 64  # listener: connections in their handshake at once (a newcomer displaces the oldest)
    stall_timeout: float = 120.0  # longest wait for a frame's message header before giving up
    # largest message accepted from the peer, checked before anything is allocated for it (None: 16 MiB on a
    # listener, which in wsync hears only control messages from subscribers; 64 GiB on a dialler)
    max_message: int | None = None
    max_resends: int = 3  # times one frame may fail its checksum in a row before ChecksumError
    linger: float = 5.0  # close(): seconds to wait for the peer to acknowledge what was sent
    congestion: str | None = None  # TCP_CONGESTION for every connection, e.g. "bbr" or "cubic" (None: system)
    # Linux >= 6.15, ignored elsewhere: the shortest retransmission timeout (the system's is 200 ms), and the
    # longest an ACK may be delayed (40 ms), kept well under it so a delayed ACK never looks like a loss. A
    # delta version is a few hundred packets after an idle gap, so a lost tail packet whose probe is lost too
    # would otherwise wait out the system's timeout. 0: the system's.
    rto_min: float = 0.05
    delack_max: float = 0.01
    pool_bytes: int = 256 << 20  # received buffers (>= 1 MiB) kept for reuse once the caller drops them (fresh pages are slow)

    @classmethod
    def from_options(cls, params: dict, opts: dict, listening: bool = False) -> "TcpConfig":
        """Address parameters (strings; sizes like 16M) overridden by keyword options."""
        cfg = options.build(cls, params, opts, KINDS)
        if cfg.max_message is None:
            cfg.max_message = LISTEN_MAX_MESSAGE if listening else DIAL_MAX_MESSAGE
        if cfg.max_handshakes < 1:
            raise ValueError(f"max_handshakes must be at least 1, got {cfg.max_handshakes}")
        if not 1 <= cfg.streams <= 64:
            raise ValueError(f"streams must be 1..64, got {cfg.streams}")
        if not 64 << 10 <= cfg.frame_bytes <= 64 << 20:
            raise ValueError(f"frame_bytes must be 64K..64M, got {cfg.frame_bytes}")
        if cfg.rto_min < 0 or cfg.delack_max < 0 or (cfg.rto_min and cfg.delack_max * 2 > cfg.rto_min):
            raise ValueError(f"need 0 <= 2 * delack_max <= rto_min (or rto_min 0), got {cfg.delack_max}, {cfg.rto_min}")
        return cfg


KINDS = {"streams": int, "frame_bytes": "size", "sndbuf": "size", "resume_window": float, "connect_timeout": float,
         "handshake_timeout": float, "stall_timeout": float, "max_message": "size", "max_resends": int,
         "linger": float, "pool_bytes": "size", "rto_min": float, "delack_max": float, "max_handshakes": int}
LISTEN_MAX_MESSAGE, DIAL_MAX_MESSAGE = 16 << 20, 64 << 30


def listen(addr: Address, *, token=None, tls=None, **opts) -> "TcpListener":
    return TcpListener(addr, TcpConfig.from_options(addr.params, opts, listening=True), check_token(token),
                       server_context(tls))


def connect(addr: Address, *, token=None, tls=None, timeout: float = 30.0, **opts) -> TcpLink:
    """Open a link; TransportError if it is not up (all streams joined) within timeout seconds."""
    import time

    cfg = TcpConfig.from_options(addr.params, opts)
    link = ClientLink(cfg, addr.host, addr.port, check_token(token), client_context(tls))
    link.bring_up(False, time.monotonic() + timeout)
    return link


class TcpListener:
    """Accepts subscribers; each authenticated, fully joined one comes out of accept() as its own link."""

    def __init__(self, addr: Address, cfg: TcpConfig, token, tls):
        self.cfg, self.token, self.tls = cfg, token, tls
        info = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self._sock = socket.socket(info[0], socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune(self._sock, cfg)  # accepted sockets inherit the buffer sizes (and so the window scale)
        try:
            self._sock.bind(info[4])
        except OSError as e:
            self._sock.close()
            raise TransportError(f"cannot listen on {addr}: {e}") from None
        self._sock.listen(128)
        self.address = str(dataclasses.replace(addr, port=self._sock.getsockname()[1]))
        self._ready: queue.Queue = queue.Queue()
        self._links: dict[str, ServerLink] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._gate = Gate(cfg.max_handshakes, cfg.handshake_timeout)
        threading.Thread(target=self._accept_loop, daemon=True, name="wsync-listen").start()

    def accept(self, timeout: float | None = None) -> TcpLink | None:
        if self._closed:
            raise TransportError(f"listener {self.address} is closed")
        try:
            link = self._ready.get(timeout=timeout)
        except queue.Empty:
            return None
        if link is None:
            raise TransportError(f"listener {self.address} is closed")
        return link

    def close(self) -> None:
        """Stop admitting subscribers (links already accepted carry on, but can no longer resume)."""
        self._closed = True
        shut(self._sock)
        self._sock.close()
        self._gate.close()
        while not self._ready.empty():
            link = self._ready.get()
            if link is not None:
                link.close()
        self._ready.put(None)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, where = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            peer = f"{where[0]}:{where[1]}"
            entry = self._gate.enter(conn)  # before a thread exists for it: the gate bounds the threads
            threading.Thread(target=self._admit, args=(conn, peer, entry), daemon=True, name="wsync-admit").start()

    def _admit(self, conn, peer: str, entry) -> None:
        keys = None  # a refusal after the token check goes under the connection's MAC: the client believes only that
        try:
            tune(conn, self.cfg)
            conn.settimeout(self.cfg.handshake_timeout)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                self._gate.swap(entry, conn)
                conn.do_handshake()
            req, keys = server_handshake(conn, self.token, peer, entry.deadline)
            _check_request(req)
            if not self._gate.leave(entry):
                raise TransportError("handshake deadline passed, or displaced by newer connections")
            conn.settimeout(None)
            self._link_for(req, peer).attach(conn, req, keys)
        except Refused as ex:
            log.warning("tcp listener %s refused %s: %s", self.address, peer, ex)
            reply(conn, keys, error=str(ex))
            conn.close()
        except (TransportError, OSError, ValueError) as ex:
            log.warning("tcp listener %s dropped %s: %s", self.address, peer, ex)
            conn.close()
        finally:
            self._gate.leave(entry)

    def _link_for(self, req: dict, peer: str) -> ServerLink:
        sid = req["session"]
        with self._lock:
            if self._closed:
                raise Refused("listener is closing")
            if req["op"] != "open":
                link = self._links.get(sid)
                if link is None:
                    raise Refused("unknown session (it ended, expired, or the listener restarted)")
                return link
            if sid in self._links:
                raise Refused("session id already in use")
            link = self._links[sid] = ServerLink(self.cfg, peer, sid, self._on_ready, self._on_end)
            return link

    def _on_ready(self, link: ServerLink) -> None:
        self._ready.put(link)

    def _on_end(self, link: ServerLink) -> None:
        self._links.pop(link.session, None)  # no lock: called under the link's lock, a dict pop is atomic


def _check_request(req: dict) -> None:
    ok = (req.get("op") in ("open", "resume", "join") and isinstance(req.get("session"), str)
          and len(req["session"]) == 32 and type(req.get("epoch")) is int and req["epoch"] > 0
          and req.get("dir") in ("up", "down") and type(req.get("index")) is int)
    if ok and req["op"] != "join":
        ok = (type(req.get("streams")) is int and 1 <= req["streams"] <= 64 and req["dir"] == "up"
              and req["index"] == 0 and isinstance(req.get("state"), str))
    if not ok:
        raise Refused(f"malformed connection request {peer_text(req)}")
