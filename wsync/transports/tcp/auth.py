"""The tcp:// connection handshake: protocol version, HMAC token proof, stream join; socket tuning; TLS.

Every TCP connection of a link (each stream, and each reconnect) runs this
handshake before any record flows, so no unauthenticated byte ever reaches the
link. Both sides prove the shared token without sending it::

    C -> S  b"WSH1" u16 version, 32-byte client nonce
    S -> C  b"WSH1" u16 version, u8 auth, 32-byte server nonce,
            HMAC-SHA256(token, "wsync-server" | client nonce | server nonce)
    C -> S  HMAC-SHA256(token, "wsync-client" | server nonce | client nonce)
    C -> S  u32 length, request JSON (session id, epoch, stream index, stream count, resume state),
            HMAC-SHA256(token, "wsync-request" | client nonce | server nonce | request)
    S -> C  u32 length, reply JSON ({"ok": true, ...} or {"ok": false, "error": ...}),
            HMAC-SHA256(token, "wsync-reply" | client nonce | server nonce | reply)

The server checks the client's proof before it reads (or allocates room for)
the request, so a peer without the token costs it a few hundred bytes. The
whole exchange has one deadline, not one per read, so a peer that trickles a
byte at a time is dropped on time. Both documents carry a MAC because, without
TLS, a relay could rewrite them (a forged resume state would make the dialler
drop messages the listener never got). The records that follow are
authenticated too, under per-connection keys derived here from the token and
both nonces (``Keys.frames``, see mac.py), so nothing recorded on one
connection can be replayed on another.

Nonces come from ``secrets`` and MACs are compared with ``hmac.compare_digest``.
A listener without a token runs the same exchange with auth = 0, zero MACs,
and checks nothing (anyone who can reach the port can connect: use a token, or
TLS and a token, off loopback). A client that holds a token refuses a server
that cannot prove it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import ssl
import struct
import time
from dataclasses import dataclass

from ... import safejson
from ...errors import TransportError, peer_text

VERSION = 2  # 2: token proof before the request, MACs on request, reply and records
HELLO_C = struct.Struct("<4sH32s")
HELLO_S = struct.Struct("<4sHB32s32s")
LEN = struct.Struct("<I")
MAC_SIZE = 32  # HMAC-SHA256
MAGIC = b"WSH1"
MAX_JSON = 1 << 20  # request/reply JSON (a resume state lists held frames: small)

TCP_RTO_MIN_US, TCP_DELACK_MAX_US = 45, 46  # linux/tcp.h (6.15); Python's socket module does not name them yet


class Refused(TransportError):
    """The other side said no (token, version, unknown session): retrying the same request will not help."""


@dataclass(kw_only=True)
class TlsConfig:
    """TLS from files, for callers who do not build an ssl.SSLContext themselves."""

    certfile: str | None = None  # PEM certificate chain (required on the listener)
    keyfile: str | None = None  # PEM private key for certfile
    cafile: str | None = None  # PEM CA (or self-signed cert) the client trusts; None = system store
    check_hostname: bool = True  # client: the certificate must name the host dialled


def server_context(tls) -> ssl.SSLContext | None:
    if tls is None or isinstance(tls, ssl.SSLContext):
        return tls
    cfg = tls if isinstance(tls, TlsConfig) else TlsConfig(**tls)
    if not cfg.certfile:
        raise ValueError("a TLS listener needs certfile (and keyfile) or an ssl.SSLContext")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cfg.certfile, cfg.keyfile)
    return ctx


def client_context(tls) -> ssl.SSLContext | None:
    if tls is None or isinstance(tls, ssl.SSLContext):
        return tls
    cfg = tls if isinstance(tls, TlsConfig) else TlsConfig(**tls)
    ctx = ssl.create_default_context(cafile=cfg.cafile)
    ctx.check_hostname = cfg.check_hostname
    return ctx


# A receive buffer that holds a whole window of a long fat pipe (the kernel doubles it): what a connection can
# take before TCP's flow control pushes back on the sender.
RCVBUF = 16 << 20
# TCP_USER_TIMEOUT: data left unacknowledged this long breaks the connection, so a silently dead path resumes
# (within resume_window) instead of waiting out the kernel's retransmissions for many minutes.
USER_TIMEOUT = 20.0


def tune(sock: socket.socket, cfg) -> None:
    """Socket options for long fat pipes: big buffers, no Nagle, dead-peer detection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt, force, n in ((socket.SO_SNDBUF, 32, cfg.sndbuf), (socket.SO_RCVBUF, 33, RCVBUF)):
        if n:  # 0 leaves the kernel's autotuning alone
            sock.setsockopt(socket.SOL_SOCKET, opt, n)
            if sock.getsockopt(socket.SOL_SOCKET, opt) < n:
                try:  # SO_*BUFFORCE (as root) passes net.core.[rw]mem_max
                    sock.setsockopt(socket.SOL_SOCKET, force, n)
                except OSError:
                    pass
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), val)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(USER_TIMEOUT * 1000))
    for opt, seconds in ((TCP_RTO_MIN_US, cfg.rto_min), (TCP_DELACK_MAX_US, cfg.delack_max)):
        if seconds:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, int(seconds * 1e6))
            except OSError:  # before Linux 6.15: the system's timers
                pass
    if cfg.congestion:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cfg.congestion.encode())
        except OSError as e:
            raise TransportError(f"congestion control {cfg.congestion!r} is not available here: {e}") from None


def read_exact(sock: socket.socket, n: int, peer: str, deadline: float) -> bytes:
    """n bytes by the deadline (time.monotonic()): each wait gets only the time left, so trickling
    one byte at a time does not keep a handshake alive."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise socket.timeout
            sock.settimeout(left)
            k = sock.recv_into(view[got:])
        except socket.timeout:
            raise TransportError(f"{peer} did not finish the handshake in time") from None
        except OSError as e:
            raise TransportError(f"connection to {peer} lost during the handshake: {e}") from None
        if not k:
            raise TransportError(f"{peer} closed the connection during the handshake")
        got += k
    return bytes(buf)


def _mac(token: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, label + b"".join(parts), hashlib.sha256).digest()


@dataclass(frozen=True)
class Keys:
    """What one handshake with a token leaves behind: MACs bound to the token and both sides' fresh
    nonces, so nothing recorded from one connection verifies on another."""

    token: bytes
    nc: bytes  # client nonce
    ns: bytes  # server nonce

    def tag(self, label: bytes, body: bytes) -> bytes:
        return _mac(self.token, label, self.nc, self.ns, body)

    def frames(self, direction: str) -> bytes:
        """The key of the records this connection carries ("up": dialler to listener, "down": back)."""
        return _mac(self.token, b"wsync-frames-" + direction.encode(), self.nc, self.ns)


def _tag(keys: Keys | None, label: bytes, body: bytes) -> bytes:
    return keys.tag(label, body) if keys is not None else bytes(MAC_SIZE)


def _read_json(sock, peer: str, deadline: float) -> tuple[bytes, dict]:
    (n,) = LEN.unpack(read_exact(sock, LEN.size, peer, deadline))
    if n > MAX_JSON:
        raise TransportError(f"{peer} sent a {n}-byte handshake document (limit {MAX_JSON})")
    body = read_exact(sock, n, peer, deadline)
    try:
        doc = safejson.loads(body, what="handshake document")
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise TransportError(f"{peer} sent a malformed handshake document")
    return body, doc


def _token(token) -> bytes | None:
    return token.encode() if isinstance(token, str) else token


def client_handshake(sock: socket.socket, token, request: dict, peer: str,
                     deadline: float) -> tuple[dict, Keys | None]:
    """Prove the token, check the server's proof, send request; the server's reply (ok) and the
    connection's keys (None without a token), or TransportError.

    With a token, only a reply under the connection's MAC is a refusal (Refused, which callers treat as
    final): the hello and everything a peer says before it proves the token can come from anyone on the
    path, so a wrong magic, another protocol version, a listener without auth, a failed proof or an
    unauthenticated "no" is a plain TransportError, retried like a dropped connection. Without a token
    nothing can be verified and a refusal is taken as said."""
    key, nc = _token(token), secrets.token_bytes(32)
    unverified = TransportError if key is not None else Refused
    try:
        sock.sendall(HELLO_C.pack(MAGIC, VERSION, nc))
        magic, version, auth, ns, mac_s = HELLO_S.unpack(read_exact(sock, HELLO_S.size, peer, deadline))
        if magic != MAGIC:
            raise unverified(f"{peer} is not a wsync tcp listener (it answered {magic!r})")
        if version != VERSION:
            raise unverified(f"{peer} speaks wsync tcp protocol v{version}, this side v{VERSION}; "
                             "run the same wsync version on both ends")
        if key is not None and not auth:
            raise unverified(f"{peer} does not check tokens; refusing to connect with one (give it the token)")
        if key is not None and not hmac.compare_digest(mac_s, _mac(key, b"wsync-server", nc, ns)):
            raise unverified(f"{peer} failed to prove the shared token (wrong token on one side?)")
        keys = Keys(key, nc, ns) if key is not None else None
        proof = _mac(key, b"wsync-client", ns, nc) if key is not None else bytes(MAC_SIZE)
        body = json.dumps(request, separators=(",", ":")).encode()
        sock.sendall(proof + LEN.pack(len(body)) + body + _tag(keys, b"wsync-request", body))
        body, answer = _read_json(sock, peer, deadline)
        tag = read_exact(sock, MAC_SIZE, peer, deadline)
    except OSError as e:
        raise TransportError(f"handshake with {peer} failed: {e}") from None
    if keys is not None and not hmac.compare_digest(tag, keys.tag(b"wsync-reply", body)):
        raise TransportError(f"the handshake reply from {peer} failed its MAC: it was changed on the path")
    if not answer.get("ok"):
        hint = "; give this side the token (WSYNC_TOKEN, --token-file or token=)" if auth and key is None else ""
        raise Refused(f"{peer} refused the connection: {peer_text(answer.get('error', 'no reason given'))}{hint}")
    return answer, keys


def server_handshake(sock: socket.socket, token, peer: str, deadline: float) -> tuple[dict, Keys | None]:
    """Check the client's hello and token proof, then read its request; returns it with the connection's
    keys. The caller answers with reply(): the request's outcome, or the error of a Refused raised here."""
    key, ns = _token(token), secrets.token_bytes(32)
    magic, version, nc = HELLO_C.unpack(read_exact(sock, HELLO_C.size, peer, deadline))
    if magic != MAGIC:
        raise TransportError(f"not a wsync client (it sent {magic!r})")
    mac_s = _mac(key, b"wsync-server", nc, ns) if key is not None else bytes(MAC_SIZE)
    sock.sendall(HELLO_S.pack(MAGIC, VERSION, key is not None, ns, mac_s))
    if version != VERSION:
        raise TransportError(f"client speaks protocol v{version}, this listener v{VERSION}")  # it reads ours
    try:
        proof = read_exact(sock, MAC_SIZE, peer, deadline)
    except TransportError:
        if key is None:
            raise
        raise Refused("peer hung up at the token check (it holds another token, or none)") from None
    if key is not None and not hmac.compare_digest(proof, _mac(key, b"wsync-client", ns, nc)):
        raise Refused("bad or missing token")
    keys = Keys(key, nc, ns) if key is not None else None
    body, request = _read_json(sock, peer, deadline)  # only now: the peer holds the token
    tag = read_exact(sock, MAC_SIZE, peer, deadline)
    if keys is not None and not hmac.compare_digest(tag, keys.tag(b"wsync-request", body)):
        raise TransportError("the connection request failed its MAC: it was changed on the path")
    return request, keys


def reply(sock: socket.socket, keys: Keys | None, error: str | None = None, **fields) -> None:
    """Answer a connection request; with keys, under a MAC the client checks before it trusts an ok."""
    body = json.dumps({"ok": False, "error": error} if error else {"ok": True, **fields},
                      separators=(",", ":")).encode()
    try:
        sock.sendall(LEN.pack(len(body)) + body + _tag(keys, b"wsync-reply", body))
    except OSError:
        pass
